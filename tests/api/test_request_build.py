"""The one EngineRequest, built whole and immutable, routed as a copy; the window's one rule (no engine, no Ray)."""

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from deployments.ingress.chat_run import gate_after_thinking
from deployments.ingress.engine_request import ReplyAsks, engine_request
from deployments.ingress.openai.models import read_chat_body
from deployments.messages.render import ReplyFormat, TokenizerCard
from deployments.messages.requests import EngineRequest, GrammarSpec, ImprintQuery
from deployments.messages.window import (
    CODE,
    counts_messages_first,
    measures_text_first,
    messages_past_window,
    prompt_past_window,
    reply_past_window,
    text_past_window,
    tokens_past_window,
)
from deployments.routing.request_router import PrefixAffinityRouter
from tests.support.bodies import USER

CARD = TokenizerCard(vocab_size=100, eos_token_ids=[2], has_chat_template=True, max_token_bytes=4)
THINKING = ReplyFormat(think_opener_id=5, think_closer_id=6, prompt_opens_thinking=True, enable_thinking=True)


def test_an_engine_request_is_built_whole_and_cannot_change() -> None:
    fields = read_chat_body({"messages": USER, "guided_regex": "a+", "max_tokens": 3, "stop_token_ids": [7]})
    assert fields.grammar == GrammarSpec("regex", "a+", param="guided_regex")  # compiled as the body was parsed
    gated = gate_after_thinking(fields.grammar, THINKING)
    assert (gated.think_closer_id, gated.starts_in_think, fields.grammar.think_closer_id) == (6, True, None)
    asks = ReplyAsks(grammar=gated, logprobs=None, streamed=True)
    request = engine_request(fields, "chatcmpl-1", [1, 2, 3], "messages", CARD, 10.0, asks)
    assert (request.grammar, request.streamed, request.max_tokens) == (gated, True, 3)
    assert request.sampling.stop_token_ids == [7]
    for frozen, name in ((request, "grammar"), (request.sampling, "seed"), (gated, "source")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(frozen, name, None)


def _router() -> PrefixAffinityRouter:
    """The router's own logic over duck-typed replicas (Serve builds the real one in each Ingress process)."""
    router = object.__new__(PrefixAffinityRouter)
    router.initialize_state(block_size=4)
    return router


@pytest.mark.parametrize("sent", [EngineRequest("r1", list(range(10, 30))), ImprintQuery(list(range(10, 30)))])
def test_the_router_sends_a_routed_copy_and_leaves_the_request_as_built(sent: EngineRequest | ImprintQuery) -> None:
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=name), routing_stats={}) for name in "ab"]
    pending = SimpleNamespace(
        args=[sent, "other"],
        routing_context=SimpleNamespace(should_backoff=False),
        metadata=SimpleNamespace(internal_request_id="i1"),
        future=object(),  # what the router counts an attempt by
    )
    (chosen,) = asyncio.run(_router().choose_replicas(replicas, pending))  # type: ignore[arg-type]
    routed = pending.args[0]
    assert routed is not sent and pending.args[1] == "other" and len(chosen) == 1
    assert routed.route_reason and routed.prompt_hashes is not None and routed.prompt_hashes.block_size == 4
    assert (sent.route_reason, sent.prompt_hashes) == ("", None)
    assert dataclasses.replace(routed, route_reason="", prompt_hashes=None) == sent


def test_the_window_rule_and_its_words() -> None:
    assert prompt_past_window(8, 7, "messages") is None
    full = prompt_past_window(8, 8, "prompt")
    assert full is not None and (full.param, full.code, full.status) == ("prompt", CODE, 400)
    assert "your prompt has 8 tokens, which leaves no room for a reply" in full.message
    assert reply_past_window(8, 3, 5, "messages") is None and reply_past_window(8, 3, None, "messages") is None
    over = reply_past_window(8, 3, 6, "messages")
    assert over is not None and "you requested 9 tokens (3 in the prompt, 6 for the reply)" in over.message
    assert tokens_past_window(8, 8, 1, "messages") == full.__class__(full.message, "messages", CODE)
    assert text_past_window("a" * 28, 4, 8, "prompt") is None and text_past_window("a" * 32, 4, None, "prompt") is None
    assert "at least 8 tokens" in text_past_window("a" * 29, 4, 8, "prompt").message  # type: ignore[union-attr]
    assert messages_past_window(8, 8, "messages") is None and messages_past_window(9, 8, "messages") is not None
    assert not counts_messages_first(256) and counts_messages_first(257)
    assert not measures_text_first((64 << 10) - 1) and measures_text_first(64 << 10)

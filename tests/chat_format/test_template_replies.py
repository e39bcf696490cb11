"""Replies written as each vendor template shows them read back into the turn they came from.

A template renders an assistant turn (reasoning, content, two calls with typed arguments) into the history
of the next prompt; what follows the generation prompt up to the end of the turn is the reply a model
trained on that template writes. Parsed with the ReplyFormat the prompt gave, whole and streamed, it holds
the turn's reasoning, content and calls again, arguments typed by the tools' schemas. The same texts feed
the forced-call grammars in test_forced_tool_templates.py.
"""

import json
from pathlib import Path
from typing import Any

import pytest

from deployments.chat_format.rendering import PromptRenderer
from deployments.chat_format.reply_parser import ReplyParser
from deployments.messages.render import ChatRenderRequest, ReplyFormat
from deployments.tokenizer import load_tokenizer
from tests.chat_format.test_reply_parser import both
from tests.conftest import REPO

VENDOR_TEMPLATES = REPO.parent / "shared" / "fixtures" / "chat_templates"
TEMPLATES_WITH_CALLS = {  # name: template file
    "tiny-glm": REPO / "serve_app" / "fixtures" / "tiny_glm" / "chat_template.jinja",
    "GLM-4.6": VENDOR_TEMPLATES / "GLM-4.6.jinja",
    "GLM-4.7-Flash": VENDOR_TEMPLATES / "GLM-4.7-Flash.jinja",
    "Qwen3": VENDOR_TEMPLATES / "Qwen3.jinja",
    "Qwen3-Coder": VENDOR_TEMPLATES / "Qwen3-Coder.jinja",
    "Qwen3.5": VENDOR_TEMPLATES / "Qwen3.5-4B.jinja",
    "Nemotron-3": VENDOR_TEMPLATES / "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
    "Gemma-4": VENDOR_TEMPLATES / "google-gemma-4-31B-it.jinja",
}
WITHOUT_THINKING = {"Qwen3-Coder"}  # its template shows no reasoning
# The ChatML templates' end token and Gemma 4's; the GLM ones end a turn with the next role's. Gemma's
# turn of calls ends with `<|tool_response>` instead (the parser reads it as the reply's end too).
END_OF_TURN = ("<|im_end|>", "<turn|>", "<|tool_response>")
EMPTY_THOUGHT = "<|channel>thought\n<channel|>"  # Gemma 4's prompt with thinking off; history turns lack it
PROPERTIES = {
    "city": {"type": "string"},
    "days": {"type": "integer"},
    "metric": {"type": "boolean"},
    "hours": {"type": "array"},
    "at": {"type": "object"},
    "note": {"type": "null"},
    "text": {"type": "string"},
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": PROPERTIES}},
    }
]
FIRST = {"city": "Oslo", "days": 2, "metric": True, "hours": [6, 18], "at": {"lat": 59.9}}
SECOND = {"note": None, "text": "two\nlines, <b>bold</b>"}
USER = [{"role": "user", "content": "Plan it."}]


def template_source(name: str, files: dict[str, Path]) -> str:
    path = files[name]
    if not path.exists():
        pytest.skip(f"{path} is not beside this checkout (vendor templates live in ../shared)")
    return path.read_text(encoding="utf-8")


def tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def shown_reply(
    renderer: PromptRenderer, tools: list[dict[str, Any]], turn: dict[str, Any], kwargs: dict[str, Any]
) -> tuple[str, ReplyFormat]:
    """The reply `turn` is shown as after the prompt that asks for it, and that prompt's ReplyFormat."""
    asking = ChatRenderRequest(USER, tools, dict(kwargs))
    prompt, _ = renderer.render_text(asking)
    history, _ = renderer.render_text(
        ChatRenderRequest([*USER, turn], tools, dict(kwargs), add_generation_prompt=False)
    )
    if not history.startswith(prompt) and prompt.endswith(EMPTY_THOUGHT):
        prompt = prompt.removesuffix(EMPTY_THOUGHT)  # the model writes its reply after the empty block
    assert history.startswith(prompt), (prompt[-80:], history[len(prompt) - 80 :])
    reply = history[len(prompt) :]
    end = max(reply.rfind(marker) for marker in END_OF_TURN)
    return (reply if end < 0 else reply[:end]), renderer.render_chat(asking).reply


def renderer_for(source: str, tokenizer_dir: Path) -> PromptRenderer:
    if "<|turn>" in source:  # Gemma 4's markup is single ids only in its own vocabulary
        from serve_app.fixtures.tokenizer_builder import build_tokenizer

        tokenizer_dir = build_tokenizer(tokenizer_dir.parent / "gemma-tok", vocab_size=512, family="gemma")
    bundle = load_tokenizer(tokenizer_dir)
    bundle.chat_template = source
    return PromptRenderer(bundle)


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("name", sorted(TEMPLATES_WITH_CALLS))
def test_a_shown_turn_reads_back_whole_and_streamed(chatml_tokenizer_dir: Path, name: str, thinking: bool) -> None:
    renderer = renderer_for(template_source(name, TEMPLATES_WITH_CALLS), chatml_tokenizer_dir)
    turn = {
        "role": "assistant",
        "content": "Checking both.",
        "tool_calls": [tool_call("get_weather", FIRST), tool_call("get_weather", SECOND)],
    }
    if thinking:
        turn["reasoning_content"] = "two calls"
    text, reply = shown_reply(renderer, TOOLS, turn, {"enable_thinking": thinking})
    view = both(ReplyParser(reply, TOOLS), text)
    reasoning = "two calls" if thinking and name not in WITHOUT_THINKING else None
    assert (view.reasoning, view.content) == (reasoning, "Checking both."), text
    first = dict(FIRST)
    if name == "Qwen3-Coder":  # its template writes objects as Python does (`{'lat': 59.9}`): they stay text
        first["at"] = str(FIRST["at"])
    assert [(c.name, json.loads(c.arguments)) for c in view.calls] == [("get_weather", first), ("get_weather", SECOND)]

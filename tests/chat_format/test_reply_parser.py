"""Reply parsing: reasoning, content and tool calls, whole and streamed alike (pure logic, no model)."""

import json

import pytest

from deployments.chat_format.markups import GLM, HERMES, QWEN_XML, markup_for_template
from deployments.chat_format.reply_parser import ReplyParser, ReplyStream, ReplyView
from deployments.chat_format.tool_calls import typed_value
from deployments.ingress.openai.chat_reply import ChatReply
from deployments.messages.render import ReplyFormat

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
}
TOOLS = [WEATHER, ADD]
GLM_REPLY = ReplyFormat(tool_format=GLM)
GLM_OPENED = ReplyFormat(tool_format=GLM, prompt_opens_thinking=True)


def streamed(parser: ReplyParser, text: str, step: int, end_token: bool = True) -> ReplyView:
    """Feed `text` in pieces of `step` characters; rebuild the reply from the deltas alone (deltas are only
    ever appended, so equality with the whole view also shows no call markup was streamed as reasoning)."""
    stream = ReplyStream(parser)
    reasoning, content, calls = "", "", []
    deltas = [stream.feed(text[i : i + step]) for i in range(0, len(text), step)] + [stream.finish(end_token)]
    for delta in deltas:
        reasoning += delta.reasoning
        content += delta.content
        calls.extend(call for _, call in delta.calls)
    return ReplyView(reasoning or None, content, calls)


def both(parser: ReplyParser, text: str, end_token: bool = True) -> ReplyView:
    """The whole-reply view, checked equal to every streamed split of the same text."""
    whole = parser.view(text, final=True, ended_by_end_token=end_token)
    for step in (1, 3, 7, len(text) or 1):
        piece = streamed(parser, text, step, end_token)
        assert (piece.reasoning or None, piece.content, piece.calls) == (
            whole.reasoning or None,
            whole.content,
            whole.calls,
        ), step
    return whole


def args(view: ReplyView, index: int = 0) -> dict:
    return json.loads(view.calls[index].arguments)


# ---- reasoning ------------------------------------------------------------------------------------------
def test_reply_written_think_is_removed_and_content_has_no_markup() -> None:
    view = both(ReplyParser(GLM_REPLY), "<think>A greeting.</think>Hello! I am tiny-glm.")
    assert view.reasoning == "A greeting." and view.content == "Hello! I am tiny-glm."


def test_prompt_opened_think_and_qwen_newlines() -> None:
    view = both(ReplyParser(GLM_OPENED), "Let me think.\n</think>\n\nParis.")
    assert (view.reasoning, view.content) == ("Let me think.", "Paris.")
    qwen = both(ReplyParser(ReplyFormat(tool_format=HERMES)), "<think>\nhm\n</think>\n\nAnswer  with  spaces ")
    assert (qwen.reasoning, qwen.content) == ("hm", "Answer  with  spaces ")


def test_no_think_section_and_a_cut_inside_reasoning() -> None:
    plain = both(ReplyParser(ReplyFormat()), "  Just text <thin")
    assert plain.reasoning is None and plain.content == "  Just text <thin"
    cut = both(ReplyParser(GLM_OPENED), "still thinking", end_token=False)
    assert (cut.reasoning, cut.content, cut.calls) == ("still thinking", "", [])


def test_thinking_off_prompt_drops_the_leading_blank_line() -> None:
    view = both(ReplyParser(ReplyFormat(prompt_closes_thinking=True)), "\n\nHi")
    assert view.content == "Hi" and view.reasoning is None


# ---- GLM calls ------------------------------------------------------------------------------------------
def test_glm_compact_and_newline_styles_typed_by_schema() -> None:
    parser = ReplyParser(GLM_REPLY, TOOLS)
    compact = both(
        parser,
        "<tool_call>add<arg_key>a</arg_key><arg_value>2</arg_value>"
        "<arg_key>b</arg_key><arg_value>3.5</arg_value></tool_call>",
    )
    assert compact.calls[0].name == "add" and args(compact) == {"a": 2, "b": 3.5} and compact.content == ""
    newline = both(
        parser,
        "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
        "</tool_call>",
    )
    assert newline.content == "Let me check." and args(newline) == {"city": "Paris", "days": 3}


def test_glm_key_without_its_open_tag_gets_it_back() -> None:
    text = "<tool_call>get_weather\ncity</arg_key><arg_value>Oslo</arg_value></tool_call>"
    view = both(ReplyParser(GLM_REPLY, TOOLS), text)
    assert view.calls[0].name == "get_weather" and args(view) == {"city": "Oslo"}


def test_parallel_calls_and_parallel_false_keeps_the_first() -> None:
    text = (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>London</arg_value></tool_call>"
    )
    assert [args(both(ReplyParser(GLM_REPLY, TOOLS), text), i)["city"] for i in (0, 1)] == ["Paris", "London"]
    single = both(ReplyParser(GLM_REPLY, TOOLS, parallel_tool_calls=False), text)
    assert len(single.calls) == 1 and args(single) == {"city": "Paris"}


def test_unoffered_wellformed_call_returns_and_malformed_stays_content() -> None:
    parser = ReplyParser(GLM_REPLY, TOOLS)
    unknown = both(parser, "<tool_call>get_time<arg_key>zone</arg_key><arg_value>UTC</arg_value></tool_call>")
    assert unknown.calls[0].name == "get_time" and args(unknown) == {"zone": "UTC"}
    broken = "<tool_call>get weather<arg_value>x</tool_call> then prose"
    view = both(parser, broken)
    assert view.calls == [] and view.content == broken


def test_end_token_inside_a_call_closes_it_but_a_length_cut_does_not() -> None:
    parser = ReplyParser(GLM_REPLY, TOOLS)
    text = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome"
    closed = both(parser, text, end_token=True)
    assert args(closed) == {"city": "Rome"} and closed.content == ""
    cut = both(parser, text, end_token=False)
    assert cut.calls == [] and cut.content == text


def test_call_inside_an_unclosed_think_block_is_the_call_but_a_mentioned_one_stays_reasoning() -> None:
    parser = ReplyParser(GLM_REPLY, TOOLS)
    call = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Tokyo</arg_value></tool_call>"
    ended = both(parser, "<think>I should call it." + call)
    assert ended.reasoning == "I should call it." and ended.calls[0].name == "get_weather"
    mentioned = both(parser, "<think>Maybe " + call + " no.</think>It is fine.")
    assert mentioned.calls == [] and call in (mentioned.reasoning or "") and mentioned.content == "It is fine."


def test_without_offered_tools_markup_is_content() -> None:
    text = "<tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
    assert both(ReplyParser(GLM_REPLY, None), text).content == text


# ---- Qwen XML and Hermes ------------------------------------------------------------------------------------
SCHEMA_TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {
                "n": {"type": "integer"},
                "x": {"type": "number"},
                "ok": {"type": "boolean"},
                "o": {"type": "object"},
                "l": {"type": "array"},
                "z": {"type": "null"},
                "s": {"type": "string"},
                "u": {"type": ["string", "integer"]},
            },
        },
    },
}


def test_qwen_xml_values_follow_the_schema_and_strings_keep_whitespace() -> None:
    def param(key: str, value: str) -> str:
        return f"<parameter={key}>\n{value}\n</parameter>\n"

    body = "".join(
        [
            param("n", "7"),
            param("x", "2.5"),
            param("ok", "true"),
            param("o", '{"k": 1}'),
            param("l", "[1, 2]"),
            param("z", "null"),
            param("s", "  two\n lines "),
            param("u", "5"),
        ]
    )
    text = f"Sure.\n<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"
    view = both(ReplyParser(ReplyFormat(tool_format=QWEN_XML), [SCHEMA_TOOL]), text)
    assert view.content == "Sure." and args(view) == {
        "n": 7,
        "x": 2.5,
        "ok": True,
        "o": {"k": 1},
        "l": [1, 2],
        "z": None,
        "s": "  two\n lines ",
        "u": "5",
    }


@pytest.mark.parametrize(
    ("raw", "kind", "expected"),
    [
        ("7.5", "integer", "7.5"),
        ("yes", "boolean", "yes"),
        ("[1", "array", "[1"),
        ("{}", "array", "{}"),
        ("1", "number", 1),
        ("true", "integer", "true"),
        ("x", "null", "x"),
    ],
)
def test_mismatched_values_stay_strings(raw: str, kind: str, expected: object) -> None:
    assert typed_value(raw, {"type": kind}) == expected


def test_python_scalars_read_only_where_asked_and_typed() -> None:
    assert [typed_value(v, {"type": "boolean"}, python_scalars=True) for v in ("True", " False\n")] == [True, False]
    assert typed_value("None", {"type": "null"}, python_scalars=True) is None
    assert typed_value("True", {"type": "boolean"}) == "True"  # GLM's and Hermes' templates write JSON
    for kind in ("string", "integer", "number"):  # a string stays as written; a mismatch stays a string
        assert typed_value("True", {"type": kind}, python_scalars=True) == "True"
    assert typed_value("None", {"type": "object"}, python_scalars=True) == "None"


def test_hermes_json_calls_and_bare_json_stays_content() -> None:
    parser = ReplyParser(ReplyFormat(tool_format=HERMES), TOOLS)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    view = both(parser, "<think>\nok\n</think>\n\n" + call)
    assert view.reasoning == "ok" and view.calls[0].name == "add" and args(view) == {"a": 1, "b": 2}
    assert both(parser, '{"name": "Alice", "age": 30}').content == '{"name": "Alice", "age": 30}'


def test_formats_follow_the_template() -> None:
    assert markup_for_template("<tool_call>{{name}}<arg_key>").name == GLM
    assert markup_for_template("<tool_call>\n<function=x>").name == QWEN_XML
    assert markup_for_template("<tool_call>{json}</tool_call>").name == HERMES
    assert markup_for_template("{{ messages }}") is None


# ---- OpenAI shapes ------------------------------------------------------------------------------------------
def test_streamed_call_is_a_named_delta_then_its_arguments() -> None:
    reply = ChatReply(ReplyParser(GLM_REPLY, TOOLS), end_token_ids={9})
    events = reply.feed("<think>go</think>Checking.<tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value>")
    events += reply.feed("</tool_call>") + reply.flush("stop", [1, 9])
    assert events[0] == {"reasoning_content": "go", "reasoning": "go"} and events[1] == {"content": "Checking."}
    head, body = events[2]["tool_calls"][0], events[3]["tool_calls"][0]
    assert head["id"].startswith("call_") and head["function"] == {"name": "add", "arguments": ""}
    assert body == {"index": 0, "function": {"arguments": '{"a": 1}'}}
    assert reply.finish_reason("stop") == "tool_calls"
    whole = ChatReply(ReplyParser(GLM_REPLY, TOOLS)).message("<tool_call>add</tool_call>", "stop", [1])
    assert whole["content"] is None and whole["tool_calls"][0]["function"] == {"name": "add", "arguments": "{}"}

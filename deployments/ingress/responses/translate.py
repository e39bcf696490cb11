"""A Responses body as the chat completion it runs as, and a finished reply as the turn it adds.

Input items become chat messages the way a chat client would write them: `instructions` is a leading
system message (never stored, so it is not carried to a later turn); a reasoning item's text becomes the
next assistant message's `reasoning_content`; function calls join the assistant message before them; a
function_call_output is a tool message. `input_image` parts (in messages and function_call_output outputs)
become image parts, read by the Renderer with --vision (docs/vision.md). A continuation is the stored
messages followed by the new input, so its prompt repeats the earlier one and the prompt cache resumes the
shared prefix.
"""

from dataclasses import dataclass
from typing import Any

from deployments.ingress.chat_request import ChatCompletionRequest, chat_request, image_part, joined_content
from deployments.ingress.http.errors import APIError, bad_request
from deployments.ingress.responses.models import ResponsesRequest
from deployments.ingress.responses.tools import offered_tools

INPUT_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
# A refusal naming a chat field names the Responses field it came from.
_CHAT_TO_RESPONSES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
    "reasoning_effort": "reasoning",
}
_PASSED = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "ignore_eos",
    "thinking_budget",
    "chat_template_kwargs",
    "priority",
    "draft",
    "parallel_tool_calls",
)


def _refuse(where: str, why: str) -> APIError:
    """A 400 naming the path the client sent (`input[2].content[0].image_url`)."""
    return bad_request(f"{where}: {why}", where)


def _image(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An input_image part as an image part: its image_url (a data: URL, or https:// with --vision-urls)."""
    if part.get("file_id") is not None:
        raise _refuse(f"{where}.file_id", "input_image file IDs are not supported: send image_url")
    if not isinstance(part.get("image_url"), str):
        raise _refuse(f"{where}.image_url", "must be a string (a data: URL)")
    return image_part(part["image_url"], f"{where}.image_url")


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return {"type": "text", "text": part["refusal"]}
    if kind == "input_image":
        return _image(part, where)
    if kind == "input_file" or (isinstance(part, dict) and "file_id" in part):
        raise _refuse(where, "input_file parts and file IDs are not supported")
    raise _refuse(where, f"content parts of type {kind!r} are not supported (send input_text or input_image)")


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """Text parts joined into one string, or, where images are, chat's text and image parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(where, "content must be a string or a list of parts")
    return joined_content([_part(part, f"{where}[{i}]") for i, part in enumerate(content)])


def _content_text(content: Any, where: str) -> str:
    """Content that may hold no image (assistant turns)."""
    joined = _content(content, where)
    if not isinstance(joined, str):
        raise _refuse(where, "images are read in user messages and function_call_output only")
    return joined


class _Messages:
    """Input items, in order, folded into chat messages."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.reasoning: list[str] | None = None  # reasoning items waiting for the next assistant message
        self.joinable = False  # the last message is an assistant turn a function call may join

    def _assistant(self, content: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            message["reasoning_content"] = "\n".join(self.reasoning)
            self.reasoning = None
        self.messages.append(message)
        self.joinable = True
        return message

    def add(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise _refuse(where, "an input item must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            self._message(item, where)
        elif kind == "function_call":
            self._call(item, where)
        elif kind == "function_call_output":
            self._call_output(item, where)
        elif kind == "reasoning":
            self._reasoning(item, where)
        elif kind == "item_reference":
            raise _refuse(where, "item_reference items are not supported: send the item, or use previous_response_id")
        else:
            raise _refuse(where, f"input items of type {kind!r} are not supported")

    def _message(self, item: dict[str, Any], where: str) -> None:
        role = item.get("role")
        if role not in INPUT_ROLES:
            raise _refuse(f"{where}.role", f"must be one of {', '.join(INPUT_ROLES)}, got {role!r}")
        if role == "assistant":
            self._assistant(_content_text(item.get("content"), f"{where}.content"))
            return
        self.messages.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
        self.joinable = False

    def _call(self, item: dict[str, Any], where: str) -> None:
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise _refuse(f"{where}.{key}", "must be a string")
        if item.get("namespace") is not None and not isinstance(item["namespace"], str):
            raise _refuse(f"{where}.namespace", "must be a string")  # the call renders under its function's name
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        message = self.messages[-1] if self.joinable else self._assistant("")
        message.setdefault("tool_calls", []).append(call)

    def _call_output(self, item: dict[str, Any], where: str) -> None:
        if not isinstance(item.get("call_id"), str):
            raise _refuse(f"{where}.call_id", "must be a string")
        output = _content(item.get("output"), f"{where}.output")
        self.messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        self.joinable = False

    def _reasoning(self, item: dict[str, Any], where: str) -> None:
        if item.get("encrypted_content") is not None:
            raise _refuse(f"{where}.encrypted_content", "encrypted reasoning is not supported (send its content)")
        content = item.get("content") or []
        if not isinstance(content, list):
            raise _refuse(f"{where}.content", "must be a list of reasoning_text parts")
        texts = [p.get("text") for p in content if isinstance(p, dict)]
        if not all(isinstance(t, str) for t in texts):
            raise _refuse(f"{where}.content", "every part needs its text")
        self.reasoning = (self.reasoning or []) + ["".join(texts)]  # type: ignore[arg-type]


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages (a string is one user message)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    folded = _Messages()
    for index, item in enumerate(value):
        folded.add(item, f"input[{index}]")
    return folded.messages


def _allowed(choice: dict[str, Any], tools: list[dict[str, Any]] | None) -> tuple[str, list[dict[str, Any]]]:
    mode, allowed = choice.get("mode"), choice.get("tools")
    if mode not in ("auto", "required") or not isinstance(allowed, list):
        raise _refuse("tool_choice", 'allowed_tools needs mode "auto" or "required" and a list of tools')
    names = set()
    for index, tool in enumerate(allowed):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise _refuse(f"tool_choice.tools[{index}]", 'only {"type": "function", "name": ...} entries are supported')
        names.add(tool["name"])
    return mode, [t for t in tools or [] if t["function"]["name"] in names]


def chat_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> tuple[Any, list[dict[str, Any]] | None]:
    """tool_choice in chat's shape, and the tools it leaves offered."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice, tools
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise _refuse("tool_choice.name", "must be a string")
        return {"type": "function", "function": {"name": choice["name"]}}, tools
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return _allowed(choice, tools)
    what = choice.get("type") if isinstance(choice, dict) else choice
    raise _refuse(
        "tool_choice", f'{what!r} is not supported: use "none", "auto", "required", a function or allowed_tools'
    )


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format (checked as the body was parsed: grammar_fields.text_format_spec) as chat's response_format
    (plain text: none)."""
    fmt = (text or {}).get("format") or {"type": "text"}
    if fmt["type"] == "json_schema":
        inner = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": inner}
    return {"type": "json_object"} if fmt["type"] == "json_object" else None


def _effort(reasoning: dict[str, Any] | None) -> Any:
    return (reasoning or {}).get("effort")


@dataclass
class ResponsesChat:
    """A Responses body translated: what runs, what is stored, and where the reply's calls belong."""

    chat: ChatCompletionRequest  # the equivalent chat completion
    conversation: list[dict[str, Any]]  # the messages without instructions (what a stored response keeps)
    namespaces: dict[str, str]  # a function offered from a namespace tool -> that namespace's name


def responses_chat(
    fields: ResponsesRequest, history: list[dict[str, Any]], drop_builtin_tools: bool = False
) -> ResponsesChat:
    """The chat completion to run and what goes with it; a refusal names chat's field (responses_error renames
    it). `drop_builtin_tools`: leave built-in tools out instead of refusing them."""
    conversation = history + input_messages(fields.input)
    system = [{"role": "system", "content": fields.instructions}] if fields.instructions else []
    chat: dict[str, Any] = {name: getattr(fields, name) for name in _PASSED}
    chat.update(
        messages=system + conversation,
        max_completion_tokens=fields.max_output_tokens,
        reasoning_effort=_effort(fields.reasoning),
    )
    tools = offered_tools(fields.tools, drop_builtin_tools)
    chat["tool_choice"], chat["tools"] = chat_tool_choice(fields.tool_choice, tools.chat)
    chat["response_format"] = response_format(fields.text)
    return ResponsesChat(chat_request(**chat), conversation, tools.namespaces)


def responses_error(exc: APIError) -> APIError:
    """A chat refusal with its param (and the field named in its message) renamed to the Responses field."""
    head = (exc.param or "").split(".")[0].split("[")[0]
    if head not in _CHAT_TO_RESPONSES:
        return exc
    renamed = _CHAT_TO_RESPONSES[head]
    param = renamed if head == "messages" else renamed + (exc.param or "")[len(head) :]
    message = exc.message if head == "messages" else exc.message.replace(head, renamed, 1)
    return APIError(exc.status, message, exc.type, param, exc.code)


def assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output as the one assistant message a chat client would send back."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    calls: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "reasoning":
            texts = "".join(part["text"] for part in item.get("content") or [])
            message["reasoning_content"] = message.get("reasoning_content", "") + texts
        elif item["type"] == "message":
            message["content"] += "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            calls.append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            )
    if calls:
        message["tool_calls"] = calls
    return message

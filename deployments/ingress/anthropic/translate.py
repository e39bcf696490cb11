"""An Anthropic Messages body as the equivalent chat completion (the one chat path runs it).

Blocks map onto chat messages: text joins into the message's content; `thinking` becomes the assistant's
`reasoning_content` (plaintext, the signature is not checked); `tool_use` becomes a tool call whose
arguments are the input as JSON; each `tool_result` becomes a `tool` message in place. A `system` message
inside `messages` keeps its place and role. `image` blocks (base64 or url sources) in user turns and tool
results become image parts, read by the Renderer with --vision (docs/vision.md). `cache_control` hints are
accepted anywhere and ignored: the prefix cache is automatic. What this server does not run (documents and
file ids, redacted thinking, server-side tools, other context edits) is a 400 naming the block.
"""

import json
from typing import Any, NoReturn

from deployments.ingress.anthropic.models import MessagesBody, MessagesRequest
from deployments.ingress.chat_request import ChatCompletionRequest, chat_request, image_part, joined_content
from deployments.ingress.http.errors import APIError, bad_request
from deployments.ingress.tool_checks import MESSAGES, check_tools

_SERVER_BLOCKS = (
    "server_tool_use",
    "web_search_tool_result",
    "web_fetch_tool_result",
    "code_execution_tool_result",
    "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result",
    "mcp_tool_use",
    "mcp_tool_result",
    "container_upload",
    "tool_search_tool_result",
)
_FILE_BLOCKS = ("document", "search_result", "file")


def _refuse(where: str, why: str) -> APIError:
    """A 400 naming the path the client sent (`messages[1].content[0].source`), in its message too: Anthropic's
    envelope has no param."""
    return bad_request(f"{where}: {why}", where)


def _refuse_block(kind: Any, where: str) -> NoReturn:
    if kind == "image":
        raise _refuse(where, "image blocks are read in user turns and tool results only")
    if kind in _FILE_BLOCKS:
        raise _refuse(where, f"{kind} blocks (documents and file ids) are not supported")
    if kind == "redacted_thinking":
        raise _refuse(where, "redacted thinking cannot be replayed on this server")
    if kind in _SERVER_BLOCKS:
        raise _refuse(where, f"server-side tool blocks ({kind}) are not supported")
    raise _refuse(where, f"unsupported content block type {kind!r}")


def _text_of(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _refuse(f"{where}.text", "must be a string")
    return text


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """A message's content as blocks: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _refuse(f"{where}.content", "must be a string or a list of content blocks")
    for index, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _refuse(f"{where}.content[{index}]", "must be an object with a type")
    return content


def _plain_text(content: Any, where: str) -> str:
    """Text-only content (system text, tool results): text blocks joined, anything else refused."""
    pieces = []
    for index, block in enumerate(_blocks(content, where)):
        if block["type"] != "text":
            _refuse_block(block["type"], f"{where}.content[{index}]")
        pieces.append(_text_of(block, f"{where}.content[{index}]"))
    return "".join(pieces)


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block as an image part: a base64 source as its data: URL, a url source as given."""
    source = block.get("source")
    at = f"{where}.source"
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise _refuse(at, "a base64 source needs media_type and data strings")
        return image_part(f"data:{media_type};base64,{data}", at)
    if kind == "url":
        if not isinstance(source.get("url"), str):
            raise _refuse(f"{at}.url", "must be a string")
        return image_part(source["url"], at)
    raise _refuse(f"{at}.type", f"image sources of type {kind!r} are not supported (send base64 or url)")


def _part(block: dict[str, Any], at: str) -> dict[str, Any]:
    """A text or image block as its chat part; anything else refused."""
    if block["type"] == "text":
        return {"type": "text", "text": _text_of(block, at)}
    if block["type"] == "image":
        return _image(block, at)
    _refuse_block(block["type"], at)


def _parts(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    return [_part(block, f"{where}.content[{index}]") for index, block in enumerate(blocks)]


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise _refuse(f"{where}.tool_use_id", "must be a nonempty string")
    content = block.get("content", "")
    result = "" if content is None else joined_content(_parts(_blocks(content, where), where))
    return {"role": "tool", "tool_call_id": call_id, "content": result}


def _user_messages(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user turn: tool results become tool messages in place; the text and images around them stay user
    content."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        if block["type"] == "tool_result":
            if parts:
                out.append({"role": "user", "content": joined_content(parts)})
                parts = []
            out.append(_tool_result(block, at))
        else:
            parts.append(_part(block, at))
    if parts or not out:
        out.append({"role": "user", "content": joined_content(parts)})
    return out


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not name or not isinstance(call_id, str) or not call_id:
        raise _refuse(where, "tool_use blocks need a nonempty id and name")
    if not isinstance(args, dict):
        raise _refuse(f"{where}.input", "must be an object")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _assistant_message(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        if block["type"] == "text":
            text.append(_text_of(block, at))
        elif block["type"] == "thinking":
            thought = block.get("thinking")
            if not isinstance(thought, str):
                raise _refuse(f"{at}.thinking", "must be a string")
            reasoning.append(thought)
        elif block["type"] == "tool_use":
            calls.append(_tool_call(block, at))
        else:
            _refuse_block(block["type"], at)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(body: MessagesBody) -> list[dict[str, Any]]:
    """The system text, then every turn, as chat messages."""
    out: list[dict[str, Any]] = []
    if body.system is not None:
        system = _plain_text(body.system, "system")
        if system:
            out.append({"role": "system", "content": system})
    if not body.messages:
        raise bad_request("messages must be a nonempty list", "messages")
    for index, message in enumerate(body.messages):
        where = f"messages[{index}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system"):
            raise _refuse(f"{where}.role", f"must be user or assistant (or system, kept in place), got {role!r}")
        blocks = _blocks(message.get("content"), where)
        if role == "user":
            out.extend(_user_messages(blocks, where))
        elif role == "assistant":
            out.append(_assistant_message(blocks, where))
        else:
            out.append({"role": "system", "content": _plain_text(blocks, where)})
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Custom tools as chat function tools; Anthropic's server-side and versioned tools are refused."""
    if not tools:
        return None
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or kind not in (None, "custom"):
            raise _refuse(
                f"tools[{index}]", f"only custom tools are supported (server-side tools such as {kind!r} are not)"
            )
    check_tools(tools, MESSAGES)
    out = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool["name"]}  # OpenAI's key order: templates render tools as JSON
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """`tool_choice` as chat's (auto / required / a named function / none) and parallel_tool_calls."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = None if choice.get("disable_parallel_tool_use") is None else not choice["disable_parallel_tool_use"]
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        if not isinstance(choice.get("name"), str) or not choice["name"]:
            raise _refuse("tool_choice.name", "is required with type tool")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _refuse("tool_choice.type", 'must be "auto", "any", "tool" or "none"')


def keeps_all_thinking(management: dict[str, Any] | None) -> bool:
    """Claude Code's keep-all thinking directive; any other context edit is refused."""
    if not management:
        return False
    edits = management.get("edits")
    if not isinstance(edits, list):
        raise _refuse("context_management.edits", "must be a list")
    for index, edit in enumerate(edits):
        keep = edit.get("keep") if isinstance(edit, dict) else None
        keep_all = keep == "all" or (isinstance(keep, dict) and keep.get("type") == "all")
        if not (isinstance(edit, dict) and str(edit.get("type", "")).startswith("clear_thinking") and keep_all):
            raise _refuse(f"context_management.edits[{index}]", "only the keep-all thinking directive is supported")
    return bool(edits)


def template_kwargs(body: MessagesBody) -> dict[str, Any]:
    """Thinking is off unless enabled or adaptive; keep-all asks the template to keep earlier reasoning."""
    thinking = body.thinking
    kwargs: dict[str, Any] = {"enable_thinking": thinking is not None and thinking.type != "disabled"}
    if keeps_all_thinking(body.context_management):
        kwargs["clear_thinking"] = False
    return kwargs


def prompt_fields(body: MessagesBody) -> dict[str, Any]:
    """The chat fields that shape the prompt (also all that count_tokens needs)."""
    choice, parallel = chat_tool_choice(body.tool_choice)
    chat: dict[str, Any] = {
        "messages": chat_messages(body),
        "tools": chat_tools(body.tools),
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "chat_template_kwargs": template_kwargs(body),
    }
    if body.output_config is not None and body.output_config.effort is not None:
        chat["reasoning_effort"] = body.output_config.effort
    return chat


def prompt_request(body: MessagesBody) -> ChatCompletionRequest:
    """The chat completion whose prompt count_tokens counts."""
    return chat_request(**prompt_fields(body))


def messages_chat(body: MessagesRequest) -> ChatCompletionRequest:
    """The whole chat completion the Messages request runs as."""
    chat = prompt_fields(body)
    chat.update(
        max_tokens=body.max_tokens,
        stop=body.stop_sequences,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        draft=body.draft,
    )
    if body.thinking is not None and body.thinking.type == "enabled":
        chat["thinking_budget"] = body.thinking.budget_tokens
    output = body.output_config
    if output is not None and output.format is not None:
        schema = {"name": "output", "schema": output.format.schema_}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    return chat_request(**chat)

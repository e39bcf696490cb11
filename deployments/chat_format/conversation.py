"""Message normalisation before a chat template sees the conversation (the system/developer rules below).

- Developer messages have system-message semantics.
- Only the leading run of system and developer messages merges, in order, into one leading system message.
- Later system and developer messages stay in place as system messages; `demote_later_system` turns them
  into user messages for templates that cannot render a system message there.
- Text content parts concatenate in order; content holding images (`{"type": "image"}` items, placed there by
  the Renderer's image reader) stays a list of text and image items, which templates with vision place.
- The caller's messages are never mutated: every function returns new dicts.
"""

import json
from typing import Any

SYSTEM_ROLES = ("system", "developer")
SYSTEM_JOINER = "\n\n"  # between merged leading system texts
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


class MessageError(ValueError):
    """A message the renderer cannot turn into template input (an HTTP 400 naming `param`, or `messages`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


IMAGES_OFF = "image input is off on this server (start it with --vision on a model with a vision tower)"


def _is_image_item(part: Any) -> bool:
    return isinstance(part, dict) and part == {"type": "image"}


def content_text(content: Any, index: int) -> str | list[dict[str, Any]] | None:
    """A message's content as one string: text parts concatenate in order; None stays None. Content with
    images stays a list: its text parts joined between the images."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and any(_is_image_item(part) for part in content):
        return _items_with_images(content, index)
    if not isinstance(content, list):
        raise MessageError(f"messages[{index}].content must be a string, null or a list of text parts")
    pieces: list[str] = []
    for part_index, part in enumerate(content):
        if isinstance(part, str):
            pieces.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        where = f"messages[{index}].content[{part_index}]"
        if kind == "image_url":  # the Renderer's image reader takes these first where images are on
            field = part.get("field") if isinstance(part.get("field"), str) else f"{where}.image_url"
            raise MessageError(f"{field}: {IMAGES_OFF}", field)
        if kind != "text" or not isinstance(part.get("text"), str):
            raise MessageError(f"{where}: only text content parts are supported (got type {kind!r})")
        pieces.append(part["text"])
    return "".join(pieces)


def _items_with_images(content: list[Any], index: int) -> list[dict[str, Any]]:
    """Text runs joined, each image item kept in its place."""
    items: list[dict[str, Any]] = []
    run: list[Any] = []
    for part in [*content, None]:
        if part is not None and not _is_image_item(part):
            run.append(part)
            continue
        if run:
            items.append({"type": "text", "text": content_text(run, index)})
            run = []
        if part is not None:
            items.append({"type": "image"})
    return items


def _decoded_call(call: Any) -> Any:
    """A call whose `arguments` is a JSON object string gets it as a dict: templates iterate its items (as vLLM)."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        decoded = json.loads(arguments)
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": decoded}} if isinstance(decoded, dict) else call


def _normalised(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A fresh copy with text content, system role for developer, and reasoning under its standard key."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise MessageError(f"messages[{index}] must be an object with a string role")
    out = dict(message)
    out["content"] = content_text(message.get("content"), index)
    if out["role"] == "developer":
        out["role"] = "system"
    if isinstance(message.get("tool_calls"), list):
        out["tool_calls"] = [_decoded_call(call) for call in message["tool_calls"]]
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is not None:
        # Templates read `reasoning_content`; gpt-oss style templates read `thinking` (as transformers does).
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def normalise_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Apply the rules above; returns new message dicts."""
    if not messages:
        raise MessageError("messages must be a nonempty list")
    normalised = [_normalised(m, i) for i, m in enumerate(messages)]
    leading = 0
    while leading < len(messages) and messages[leading].get("role") in SYSTEM_ROLES:
        leading += 1
    if leading <= 1:
        return normalised
    texts = [m["content"] for m in normalised[:leading] if m["content"]]
    merged = {"role": "system", "content": SYSTEM_JOINER.join(texts)}
    return [merged, *normalised[leading:]]


def has_later_system(messages: list[dict[str, Any]]) -> bool:
    """True when a system message follows a non-system one (after normalisation)."""
    return any(m["role"] == "system" for m in messages[1:])


def demote_later_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System messages after the first position rendered as user messages, for templates that refuse them."""
    out = [dict(messages[0])] if messages else []
    for message in messages[1:]:
        copy = dict(message)
        if copy["role"] == "system":
            copy["role"] = "user"
        out.append(copy)
    return out

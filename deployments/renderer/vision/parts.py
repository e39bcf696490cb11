"""Image parts as the Renderer receives them inside the messages, and the refusal naming the client's field.

Chat's `image_url` parts arrive as the client sent them; Messages' and Responses' images arrive translated by
Ingress into the same part with a `field` key naming where the client put it in its own body.
"""

from dataclasses import dataclass
from typing import Any

from deployments.chat_format.conversation import MessageError

IMAGE_ROLES = ("user", "tool")  # the roles whose content may carry images


class ImageRefusal(MessageError):
    """An image part the server will not read: HTTP 400 naming the part's field (`param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}", param)


@dataclass(frozen=True)
class ImagePart:
    """One image part of a request, in prompt order."""

    url: str  # a data: URL, or an https:// URL (read only with vision_urls)
    field: str  # where the client put it, e.g. messages[0].content[1].image_url
    role: str  # the message's role


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def _part(part: dict[str, Any], role: str, where: str) -> ImagePart:
    inner = part.get("image_url")
    url = inner.get("url") if isinstance(inner, dict) else None
    field = part.get("field") if isinstance(part.get("field"), str) else f"{where}.image_url"
    if not isinstance(url, str) or not url:
        raise ImageRefusal("an image part needs a URL string (a data: URL, or https:// with --vision-urls)", field)
    return ImagePart(url, field, role)


def image_parts(messages: list[dict[str, Any]]) -> list[ImagePart]:
    """Every image part, in message then part order (the order the template places them in)."""
    found: list[ImagePart] = []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part_index, part in enumerate(content):
            if is_image_part(part):
                found.append(_part(part, str(message.get("role")), f"messages[{index}].content[{part_index}]"))
    return found


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each image part as the bare item templates place (`{"type": "image"}`)."""
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(is_image_part(p) for p in content):
            content = [{"type": "image"} if is_image_part(p) else p for p in content]
            message = {**message, "content": content}
        out.append(message)
    return out

"""Image input through every route, in-process (the real Renderer and engine, no Ray): /tokenize and
count_tokens count the expanded placeholders, usage counts them, a prompt they push past the window is
refused, and every refusal is a 400 in the route's own format naming the client's field."""

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from deployments.chat_format.rendering import RendererOptions
from deployments.config import ImageSettings
from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from deployments.renderer.chat_prompts import ChatPromptRenderer
from serve_app.local_backend import LocalBackend
from tests.support.local_app import local_backend
from tests.vision.conftest import QWEN35_TEMPLATE, data_url, encoded, random_image

PNG = encoded(random_image(52, 40))  # 40 x 48 after resizing: 10 x 12 patches, 30 placeholders
PLACEHOLDERS = 30
URL = data_url(PNG)
SETTINGS = IngressSettings(served_name="tiny", model_ids=["tiny"])


def _renderer(checkpoint: Path, **settings: Any) -> ChatPromptRenderer:
    options = RendererOptions(chat_template=QWEN35_TEMPLATE.read_text())
    return ChatPromptRenderer.open(checkpoint, options, ImageSettings(**settings))


@pytest.fixture(scope="module")
def clients(vision_checkpoint: Path) -> Iterator[tuple[TestClient, TestClient]]:
    """The same engine behind two Renderers: --vision --vision-urls, and neither."""
    renderer = _renderer(vision_checkpoint, vision=True, vision_urls=True, max_images=3)
    with local_backend(str(vision_checkpoint), window=200, renderer=renderer, vision=True) as backend:
        plain = LocalBackend(_renderer(vision_checkpoint), backend.loop)
        with TestClient(build_api(backend, SETTINGS)) as vision, TestClient(build_api(plain, SETTINGS)) as text:
            yield vision, text


def _image(url: str = URL) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _messages(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]


def _tokenize(client: TestClient, messages: list[dict[str, Any]]) -> dict[str, Any]:
    reply = client.post("/tokenize", json={"model": "tiny", "messages": messages})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_tokenize_counts_expanded_placeholders(clients: tuple[TestClient, TestClient]) -> None:
    vision, _ = clients
    text_only = _tokenize(vision, _messages())["count"]
    one = _tokenize(vision, _messages(_image()))
    two = _tokenize(vision, _messages(_image(), _image()))
    # each image adds <|vision_start|>, its placeholders and <|vision_end|>
    assert one["count"] == text_only + PLACEHOLDERS + 2 == len(one["tokens"])
    assert two["count"] == text_only + 2 * (PLACEHOLDERS + 2)


def test_health_says_whether_vision_is_on(clients: tuple[TestClient, TestClient]) -> None:
    vision, text = clients
    assert vision.get("/health").json()["vision"] is True
    assert text.get("/health").json()["vision"] is False


def test_usage_counts_placeholders_and_the_window_refuses(clients: tuple[TestClient, TestClient]) -> None:
    vision, _ = clients
    messages = _messages(_image())
    body = {"model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0}
    reply = vision.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == _tokenize(vision, messages)["count"]
    reply = vision.post("/v1/chat/completions", json={**body, "messages": _messages(*[_image()] * 3, _image())})
    assert reply.status_code == 400 and "at most 3 images" in reply.json()["error"]["message"]
    wide = data_url(encoded(random_image(200, 200)))  # 64 placeholders each: 3 pass the 200-token window
    reply = vision.post("/v1/chat/completions", json={**body, "messages": _messages(*[_image(wide)] * 3)})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "context_length_exceeded"


CHAT_REFUSALS = [
    ("vision_off", "text", _messages(_image()), "messages[0].content[1].image_url", "image input is off"),
    (
        "bad_base64",
        "vision",
        _messages(_image("data:image/png;base64,%%%")),
        "messages[0].content[1].image_url",
        "malformed",
    ),
    (
        "loopback_url",
        "vision",
        _messages(_image("https://localhost/cat.png")),
        "messages[0].content[1].image_url",
        "loopback address",
    ),
    (
        "private_url",
        "vision",
        _messages(_image("https://10.0.0.5/cat.png")),
        "messages[0].content[1].image_url",
        "private address",
    ),
    (
        "http_url",
        "vision",
        _messages(_image("http://example.com/a.png")),
        "messages[0].content[1].image_url",
        "scheme 'http'",
    ),
    (
        "not_image",
        "vision",
        _messages(_image(data_url(b"GIF89a-nope", "image/gif"))),
        "messages[0].content[1].image_url",
        "not a PNG",
    ),
    (
        "tool_image_ok_but_assistant",
        "vision",
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [_image()]}],
        "messages[1].content[0].image_url",
        "not 'assistant'",
    ),
]


@pytest.mark.parametrize(
    ("case", "which", "messages", "param", "text"), CHAT_REFUSALS, ids=[c[0] for c in CHAT_REFUSALS]
)
def test_chat_refusals(
    clients: tuple[TestClient, TestClient], case: str, which: str, messages: list, param: str, text: str
) -> None:
    client = clients[0] if which == "vision" else clients[1]
    reply = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 1})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and text in error["message"]


@pytest.mark.parametrize("kind", ["input_audio", "file", "video_url"])
def test_other_modalities_refused(clients: tuple[TestClient, TestClient], kind: str) -> None:
    part = {"type": kind, kind: {"data": "AAAA"}}
    reply = clients[0].post(
        "/v1/chat/completions", json={"model": "tiny", "messages": _messages(part), "max_tokens": 1}
    )
    assert reply.status_code == 400 and f"got type {kind!r}" in reply.json()["error"]["message"]
    assert reply.json()["error"]["param"] == "messages[0].content[1].type"  # the part, not the whole list


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _anthropic_image(media_type: str = "image/png", data: str | None = None) -> dict[str, Any]:
    source = {"type": "base64", "media_type": media_type, "data": data if data is not None else URL.split(",", 1)[1]}
    return {"type": "image", "source": source}


def test_messages_images_counted(clients: tuple[TestClient, TestClient]) -> None:
    """count_tokens counts each image as its placeholders and markers, in user turns and tool results."""
    vision, _ = clients

    def body(image: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "model": "tiny",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "What is this?"}, *image]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [*image]}]},
            ],
            "tools": [{"name": "shot", "description": "a screenshot", "input_schema": {"type": "object"}}],
        }

    def count(image: list[dict[str, Any]]) -> int:
        reply = vision.post("/v1/messages/count_tokens", json=body(image))
        assert reply.status_code == 200, reply.text
        return reply.json()["input_tokens"]

    big = encoded(random_image(200, 200))  # 64 placeholders
    small_images, big_images = count([_anthropic_image()]), count([_anthropic_image(data=_b64(big))])
    assert big_images - small_images == 2 * (64 - PLACEHOLDERS)
    assert small_images > count([]) + 2 * PLACEHOLDERS


@pytest.mark.parametrize(
    ("block", "field", "text", "which"),
    [
        (_anthropic_image(), "messages[0].content[1].source", "image input is off", 1),
        (_anthropic_image("image/bmp"), "messages[0].content[1].source", "unsupported image type 'image/bmp'", 0),
        (_anthropic_image(data="!!"), "messages[0].content[1].source", "base64 data is malformed", 0),
        (
            {"type": "image", "source": {"type": "url", "url": "https://127.0.0.1/x.png"}},
            "messages[0].content[1].source",
            "loopback address",
            0,
        ),
        (
            {"type": "image", "source": {"type": "file", "file_id": "f1"}},
            "messages[0].content[1].source",
            "sources of type 'file'",
            0,
        ),
        ({"type": "document", "source": {}}, "messages", "documents and file ids", 0),
    ],
)
def test_messages_refusals(
    clients: tuple[TestClient, TestClient], block: dict, field: str, text: str, which: int
) -> None:
    body = {
        "model": "tiny",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, block]}],
    }
    reply = clients[which].post("/v1/messages", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == "invalid_request_error"
    message = reply.json()["error"]["message"]
    assert message.startswith(field) and text in message


def _responses_input(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"}, *parts]}]


def test_responses_images_counted_like_chat(clients: tuple[TestClient, TestClient]) -> None:
    vision, _ = clients
    body = {
        "model": "tiny",
        "max_output_tokens": 1,
        "temperature": 0,
        "store": False,
        "input": [
            *_responses_input({"type": "input_image", "image_url": URL}),
            {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_image", "image_url": URL}]},
        ],
    }
    reply = vision.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    chat = [
        *_messages(_image()),
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [_image()]},
    ]
    assert reply.json()["usage"]["input_tokens"] == _tokenize(vision, chat)["count"]


@pytest.mark.parametrize(
    ("part", "param", "text", "which"),
    [
        ({"type": "input_image", "image_url": URL}, "input[0].content[1].image_url", "image input is off", 1),
        ({"type": "input_image", "file_id": "file-1"}, "input[0].content[1].file_id", "file IDs are not supported", 0),
        (
            {"type": "input_image", "image_url": "data:image/png;base64,###"},
            "input[0].content[1].image_url",
            "malformed",
            0,
        ),
        (
            {"type": "input_image", "image_url": "https://169.254.169.254/latest"},
            "input[0].content[1].image_url",
            "cloud metadata address",
            0,
        ),
        ({"type": "input_file", "file_id": "file-1"}, "input[0].content[1]", "input_file parts", 0),
    ],
)
def test_responses_refusals(
    clients: tuple[TestClient, TestClient], part: dict, param: str, text: str, which: int
) -> None:
    body = {"model": "tiny", "max_output_tokens": 4, "store": False, "input": _responses_input(part)}
    reply = clients[which].post("/v1/responses", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and text in error["message"]

"""The Renderer's image input on the real Qwen3.5 template: expanded ids as transformers' processor expands
them, each image's patches and span, and every refusal naming the client's field."""

import base64
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deployments.chat_format.conversation import MessageError
from deployments.chat_format.rendering import RendererOptions
from deployments.config import ImageSettings
from deployments.messages.render import ChatRenderRequest
from deployments.renderer.chat_prompts import ChatPromptRenderer
from deployments.renderer.vision.parts import ImageRefusal
from deployments.renderer.vision.preprocess import Preprocessing
from deployments.renderer.vision.reader import ImageReader
from tests.vision.conftest import QWEN35_TEMPLATE, data_url, encoded, random_image

RED = encoded(random_image(52, 40, seed=1))
WIDE = encoded(random_image(90, 20, seed=2), "JPEG")


def _renderer(checkpoint: Path, **settings: Any) -> ChatPromptRenderer:
    options = RendererOptions(chat_template=QWEN35_TEMPLATE.read_text())
    return ChatPromptRenderer.open(checkpoint, options, ImageSettings(**{"vision": True, **settings}))


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _render(renderer: ChatPromptRenderer, messages: list[dict[str, Any]]) -> Any:
    return renderer.render_chat(ChatRenderRequest(messages=messages))


CONVERSATION = [
    {"role": "system", "content": "Look closely."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Compare "}, _image(data_url(RED)), _image(data_url(WIDE, "image/jpeg"))],
    },
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "shot", "arguments": {}}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "screen:"}, _image(data_url(RED))]},
]


def _reference_ids(checkpoint: Path, messages: list[dict[str, Any]], counts: list[int]) -> list[int]:
    """transformers' way: the template's text, each `<|image_pad|>` repeated by its image's count, tokenized."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(checkpoint)
    bare = [
        {**m, "content": [{"type": "image"} if p.get("type") == "image_url" else p for p in m["content"]]}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]
    text = tokenizer.apply_chat_template(
        bare, chat_template=QWEN35_TEMPLATE.read_text(), tokenize=False, add_generation_prompt=True
    )
    pieces = text.split("<|image_pad|>")
    assert len(pieces) == len(counts) + 1
    expanded = pieces[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, pieces[1:]))
    return tokenizer(expanded, add_special_tokens=False)["input_ids"]


def test_expanded_ids_and_images_match_transformers(vision_checkpoint: Path) -> None:
    import io

    from PIL import Image
    from transformers import AutoImageProcessor

    renderer = _renderer(vision_checkpoint)
    rendered = _render(renderer, CONVERSATION)
    processor = AutoImageProcessor.from_pretrained(vision_checkpoint)
    expected = processor(images=[Image.open(io.BytesIO(b)) for b in (RED, WIDE, RED)], return_tensors="np")
    grids = [tuple(row) for row in expected["image_grid_thw"].tolist()]
    assert [image.grid_thw for image in rendered.images] == grids
    counts = [int(np.prod(g)) // 4 for g in grids]
    assert [image.length for image in rendered.images] == counts
    assert rendered.prompt_token_ids == _reference_ids(vision_checkpoint, CONVERSATION, counts)
    pad = renderer.bundle.token_to_id("<|image_pad|>")
    for image in rendered.images:
        span = rendered.prompt_token_ids[image.offset - 1 : image.end + 1]
        assert span[1:-1] == [pad] * image.length
        assert span[0] == renderer.bundle.token_to_id("<|vision_start|>")
        assert span[-1] == renderer.bundle.token_to_id("<|vision_end|>")
    rows = np.concatenate([image.pixel_values for image in rendered.images])
    np.testing.assert_allclose(rows, expected["pixel_values"], rtol=0, atol=1e-6)
    assert rendered.images[0].sha256 == rendered.images[2].sha256 != rendered.images[1].sha256
    assert renderer.card().vision is True


def test_text_only_prompts_unchanged(vision_checkpoint: Path) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    with_vision = _render(_renderer(vision_checkpoint), messages)
    without = _render(_renderer(vision_checkpoint, vision=False), messages)
    assert with_vision.prompt_token_ids == without.prompt_token_ids and with_vision.images == []


def _refusal(renderer: ChatPromptRenderer, messages: list[dict[str, Any]]) -> tuple[str, str]:
    with pytest.raises(MessageError):
        _render(renderer, messages)
    refusal = renderer.render_or_refuse(ChatRenderRequest(messages=messages))
    return refusal.message, refusal.param or ""


def _user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "see"}, *parts]}]


FIELD = "messages[0].content[1].image_url"
REFUSALS = {
    "vision_off": ({"vision": False}, _user(_image(data_url(RED))), FIELD, "image input is off"),
    "http": ({}, _user(_image("http://example.com/a.png")), FIELD, "unsupported image URL scheme 'http'"),
    "file": ({}, _user(_image("file:///etc/passwd")), FIELD, "unsupported image URL scheme 'file'"),
    "no_scheme": ({}, _user(_image("cat.png")), FIELD, "unsupported image URL scheme 'none'"),
    "https_off": ({}, _user(_image("https://example.com/a.png")), FIELD, "image URLs are off"),
    "bad_base64": ({}, _user(_image("data:image/png;base64,@@@not base64")), FIELD, "base64 data is malformed"),
    "no_base64": ({}, _user(_image("data:image/png,rawbytes")), FIELD, "must be base64-encoded"),
    "svg": ({}, _user(_image("data:image/svg+xml;base64,PHN2Zz4=")), FIELD, "unsupported image type 'image/svg+xml'"),
    "not_an_image": ({}, _user(_image(data_url(b"hello world" * 10))), FIELD, "not a PNG, JPEG, WebP or GIF"),
    "truncated": ({}, _user(_image(data_url(encoded(random_image(64, 64))[:300]))), FIELD, "malformed or truncated"),
    "too_big": (
        {"max_image_bytes": 1024},
        _user(_image(data_url(encoded(random_image(64, 64))))),
        FIELD,
        "larger than 1024 bytes",
    ),
    "too_many_pixels": ({"max_image_pixels": 100}, _user(_image(data_url(RED))), FIELD, "more than the 100"),
    "too_many": (
        {"max_images": 2},
        _user(*[_image(data_url(RED))] * 3),
        "messages[0].content[3].image_url",
        "at most 2 images",
    ),
    "no_url": ({}, _user({"type": "image_url", "image_url": {}}), FIELD, "needs a URL string"),
    "assistant": (
        {},
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [_image(data_url(RED))]}],
        "messages[1].content[0].image_url",
        "not 'assistant' ones",
    ),
    "system": (
        {},
        [{"role": "system", "content": [_image(data_url(RED))]}, {"role": "user", "content": "hi"}],
        "messages[0].content[0].image_url",
        "not 'system' ones",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_name_the_field(vision_checkpoint: Path, case: str) -> None:
    settings, messages, field, text = REFUSALS[case]
    message, param = _refusal(_renderer(vision_checkpoint, **settings), messages)
    assert param == field and text in message and message.startswith(field)


def test_model_without_tower_refuses(vision_checkpoint: Path) -> None:
    renderer = _renderer(vision_checkpoint)
    renderer.images = ImageReader(ImageSettings(vision=True), None, renderer.images.pad_id)
    message, param = _refusal(renderer, _user(_image(data_url(RED))))
    assert param == FIELD and "no vision tower" in message
    assert renderer.card().vision is False


def test_translated_image_items_keep_their_field(vision_checkpoint: Path) -> None:
    """Messages and Responses hand over image_url parts with a `field` naming the client's own field."""
    item = {**_image("data:image/gif;base64," + base64.b64encode(b"GIF89a").decode()), "field": "x.y"}
    message, param = _refusal(_renderer(vision_checkpoint), _user(item))
    assert param == "x.y" and "not a PNG, JPEG, WebP or GIF" in message


def test_placeholder_typed_in_text_refused(vision_checkpoint: Path) -> None:
    messages = _user({"type": "text", "text": " <|image_pad|> "}, _image(data_url(RED)))
    message, param = _refusal(_renderer(vision_checkpoint), messages)
    assert param == "messages" and "2 image placeholders for 1 images" in message
    assert isinstance(Preprocessing.read(vision_checkpoint), Preprocessing)
    assert issubclass(ImageRefusal, MessageError)


def test_settings_declared_once_reach_engine_and_renderer() -> None:
    """`vision` reaches both the engine's config and the Renderer's settings; URLs need vision."""
    from pydantic import ValidationError

    from serve_app.args import AppArgs

    args = AppArgs(vision=True, vision_urls=True, max_images=2)
    assert args.engine_config().vision is True
    assert args.image_settings() == ImageSettings(vision=True, vision_urls=True, max_images=2)
    assert AppArgs().engine_config().vision is False and AppArgs().image_settings().vision is False
    with pytest.raises(ValidationError, match="vision_urls needs vision"):
        AppArgs(vision_urls=True)

"""Image input end to end: greedy reply ids over HTTP (chat, with images in a user turn and in a tool
result) equal `Qwen3_5ForConditionalGeneration.generate` fed the same prompt ids and the same
images through transformers' own image processor, float32."""

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from deployments.chat_format.rendering import RendererOptions
from deployments.config import ImageSettings
from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from deployments.renderer.chat_prompts import ChatPromptRenderer
from tests.support.local_app import local_backend
from tests.vision.conftest import QWEN35_TEMPLATE, data_url, encoded, random_image

REPLY_TOKENS = 8
PICTURES = [encoded(random_image(40, 52, seed=1)), encoded(random_image(70, 30, seed=2), "JPEG", quality=90)]


@pytest.fixture(scope="module")
def client(vision_checkpoint: Path) -> Iterator[TestClient]:
    options = RendererOptions(chat_template=QWEN35_TEMPLATE.read_text())
    renderer = ChatPromptRenderer.open(vision_checkpoint, options, ImageSettings(vision=True))
    with local_backend(str(vision_checkpoint), window=600, renderer=renderer, vision=True) as backend:
        with TestClient(build_api(backend, IngressSettings(served_name="tiny", model_ids=["tiny"]))) as served:
            yield served


@pytest.fixture(scope="module")
def reference(vision_checkpoint: Path):
    from transformers import AutoImageProcessor, Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(vision_checkpoint, dtype=torch.float32).eval()
    return model, AutoImageProcessor.from_pretrained(vision_checkpoint)


def _expected(reference: Any, prompt_ids: list[int], pictures: list[bytes]) -> list[int]:
    model, processor = reference
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in pictures]
    patches = processor(images=images, return_tensors="pt")
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            # what transformers' Qwen3.5 processor returns beside the ids: which rows are image placeholders
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
            pixel_values=patches["pixel_values"],
            image_grid_thw=patches["image_grid_thw"],
            max_new_tokens=REPLY_TOKENS,
            do_sample=False,
        )
    return out[0, len(prompt_ids) :].tolist()


def _image(data: bytes) -> dict[str, Any]:
    media = "image/jpeg" if data[:2] == b"\xff\xd8" else "image/png"
    return {"type": "image_url", "image_url": {"url": data_url(data, media)}}


def _chat(client: TestClient, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": REPLY_TOKENS}
    reply = client.post("/v1/chat/completions", json={**body, "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    payload = reply.json()
    return payload["prompt_token_ids"], payload["choices"][0]["token_ids"]


def test_one_image_equals_transformers(client: TestClient, reference: Any) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is here?"}, _image(PICTURES[0])]}]
    prompt, reply = _chat(client, messages)
    assert reply == _expected(reference, prompt, PICTURES[:1])


def test_two_images_equal_transformers(client: TestClient, reference: Any) -> None:
    content = [_image(PICTURES[0]), {"type": "text", "text": "and"}, _image(PICTURES[1])]
    prompt, reply = _chat(client, [{"role": "user", "content": content}])
    assert reply == _expected(reference, prompt, PICTURES)


def test_image_in_a_tool_result_equals_transformers(client: TestClient, reference: Any) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": [_image(PICTURES[1])]},
    ]
    prompt, reply = _chat(client, messages)
    assert reply == _expected(reference, prompt, PICTURES[1:])


def test_same_screenshot_next_turn_is_a_cache_hit_and_a_swapped_one_is_not(client: TestClient) -> None:
    first = [{"role": "user", "content": [_image(PICTURES[0]), {"type": "text", "text": "Look."}]}]
    body = {"model": "tiny", "temperature": 0, "max_tokens": 2}
    client.post("/v1/chat/completions", json={**body, "messages": first})
    again = client.post("/v1/chat/completions", json={**body, "messages": first}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    swapped_picture = encoded(random_image(40, 52, seed=9))  # same size: identical placeholder ids
    swapped = [{"role": "user", "content": [_image(swapped_picture), {"type": "text", "text": "Look."}]}]
    reply = client.post("/v1/chat/completions", json={**body, "messages": swapped}).json()
    prefix_before_image = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    image_start = _chat(client, swapped)[0].index(_pad_id(client))
    assert prefix_before_image <= image_start  # nothing at or past the image is served from the cache


def _pad_id(client: TestClient) -> int:
    return client.post("/tokenize", json={"model": "tiny", "prompt": "<|image_pad|>"}).json()["tokens"][-1]


def test_messages_image_block_is_the_same_image_to_the_cache(client: TestClient) -> None:
    """A Messages image block after a chat image part with the same pixels: read back from the prefix cache."""
    import base64

    question = {"type": "text", "text": "What is here?"}
    prompt, _ = _chat(client, [{"role": "user", "content": [question, _image(PICTURES[0])]}])
    last_placeholder = len(prompt) - 1 - prompt[::-1].index(_pad_id(client))
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PICTURES[0]).decode()}
    body = {"model": "tiny", "max_tokens": REPLY_TOKENS, "temperature": 0}
    messages = [{"role": "user", "content": [question, {"type": "image", "source": source}]}]
    reply = client.post("/v1/messages", json={**body, "messages": messages})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["cache_read_input_tokens"] > last_placeholder

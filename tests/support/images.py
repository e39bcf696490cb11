"""Images for the vision tests, made without the Renderer: transformers' image processor cuts each picture
into patches, the test expands its placeholders as the processor does, and transformers' multimodal model
is the reference for the greedy reply."""

import hashlib
from pathlib import Path

import numpy as np
import torch

from deployments.messages.images import ImageInput
from tests.support.reference import hf_model

VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"


def picture(seed: int, height: int, width: int) -> np.ndarray:
    """Random RGB pixels [height, width, 3] uint8."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def pixels_sha256(pixels: np.ndarray) -> bytes:
    """The image's name: SHA-256 of RGB, its width and height, then the raw bytes."""
    height, width = pixels.shape[:2]
    return hashlib.sha256(
        b"RGB" + width.to_bytes(4, "little") + height.to_bytes(4, "little") + pixels.tobytes()
    ).digest()


class ImagePrompts:
    """Prompts of text ids and pictures over one vision checkpoint."""

    def __init__(self, checkpoint: Path) -> None:
        from transformers import AutoImageProcessor

        from deployments.tokenizer import load_tokenizer

        self.checkpoint = Path(checkpoint)
        self.processor = AutoImageProcessor.from_pretrained(checkpoint)
        vocab = load_tokenizer(checkpoint).tokenizer
        self.start, self.end, self.pad = (vocab.token_to_id(t) for t in (VISION_START, VISION_END, IMAGE_PAD))
        self.merge = int(self.processor.merge_size)

    def build(self, parts: list[list[int] | np.ndarray]) -> tuple[list[int], list[ImageInput]]:
        """Prompt ids and ImageInputs: each picture becomes vision_start, its placeholders, vision_end."""
        ids: list[int] = []
        images: list[ImageInput] = []
        for part in parts:
            if isinstance(part, list):
                ids += part
                continue
            out = self.processor(images=[part], return_tensors="np")
            grid = tuple(int(n) for n in out["image_grid_thw"][0])
            length = grid[0] * grid[1] * grid[2] // self.merge**2
            ids.append(self.start)
            images.append(
                ImageInput(pixels_sha256(part), grid, out["pixel_values"].astype(np.float32), len(ids), length)
            )
            ids += [self.pad] * length + [self.end]
        return ids, images


def hf_image_greedy(checkpoint: Path, ids: list[int], images: list[ImageInput], new_tokens: int) -> list[int]:
    """transformers' greedy reply (end tokens ignored) to the prompt with its images' patches."""
    model = hf_model(checkpoint)
    image_token = model.config.image_token_id
    inputs = dict(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == image_token).int()
    if images:
        inputs["pixel_values"] = torch.from_numpy(np.concatenate([image.pixel_values for image in images]))
        inputs["image_grid_thw"] = torch.tensor([list(image.grid_thw) for image in images])
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    return out[0, len(ids) :].tolist()


def vision_checkpoint(out: Path, arch: str = "qwen3_5", dtype: str = "float32", seed: int = 5) -> Path:
    """A tiny random multimodal checkpoint, as `tensorfold fixture checkpoint --arch qwen3_5` writes it."""
    from serve_app.fixtures.checkpoints import build_random_checkpoint
    from serve_app.fixtures.tokenizer_builder import build_tokenizer
    from serve_app.fixtures.vision import use_vision_tokens

    build_tokenizer(out, family="qwen_vl")
    build_random_checkpoint(arch, out, seed=seed, dtype=dtype)
    return use_vision_tokens(out)

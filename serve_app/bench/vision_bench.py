"""`tensorfold bench vision`: one image's encode time and a one-image chat's first token, ours against
transformers' on one multimodal checkpoint, in one run.

Both sides start from the same PNG bytes. Encode: our Renderer's decoding and patches, then our tower,
against transformers' image processor and `get_image_features`. TTFT: the same, then the prompt's prefill
and first token (our offline Engine, one request, max_tokens 1) against `generate(max_new_tokens=1)` on the
same ids. Each figure is the median over --images distinct pictures, after one warm-up picture; the sides
take turns picture by picture. The greedy first tokens are printed side by side as a sanity check.
"""

import argparse
import io
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from deployments.config import EngineConfig, ImageSettings
from deployments.renderer.vision.decode import decode_image, pixels_sha256
from deployments.renderer.vision.preprocess import Preprocessing, image_patches, placeholder_count
from deployments.renderer.vision.reader import ImageReader, LoadedImage
from deployments.scheduler.engine.core import Engine
from deployments.tokenizer import load_tokenizer
from kernels import cpu_native
from serve_app.bench.workload import bench_checkpoint, bench_requests

CHAT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in this picture?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@dataclass
class Figures:
    """One side's medians over the pictures, and its greedy first token for each."""

    encode_s: list[float]  # PNG bytes to the tower's embeddings, per picture
    ttft_s: list[float]  # PNG bytes to the first token of the one-image chat, per picture
    first_tokens: list[int]


def picture_png(seed: int, width: int, height: int) -> bytes:
    """A seeded picture as PNG bytes: smooth colour ramps under noise, so it compresses as photos do."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, width)[None, :, None] * rng.uniform(0.2, 1.0, 3)
    noise = rng.normal(0, 24, (height, width, 3))
    pixels = np.clip(ramp + noise, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _timed(work: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    result = work()
    return time.perf_counter() - start, result


class OurSide:
    """The Renderer's image reading and the offline Engine with vision on."""

    def __init__(self, checkpoint: Path, dtype: str) -> None:
        self.engine = Engine(
            EngineConfig(
                model=str(checkpoint),
                dtype=dtype,
                kv_cache_gib=0.25,
                parallel=1,
                engine_threads=torch.get_num_threads(),
                draft="off",
                vision=True,
                prompt_cache_gib=0,  # every TTFT computes its whole prompt
            )
        )
        prep = Preprocessing.read(checkpoint)
        assert prep is not None, f"{checkpoint} has no preprocessor_config.json"
        self.prep = prep
        tokenizer = load_tokenizer(checkpoint).tokenizer
        self.settings = ImageSettings(vision=True)
        self.reader = ImageReader(self.settings, prep, tokenizer.token_to_id("<|image_pad|>"))
        self.chat_ids = tokenizer.encode(CHAT).ids

    def load(self, png: bytes) -> LoadedImage:
        image = decode_image(png, self.settings.max_image_pixels)
        grid, rows = image_patches(image, self.prep)
        return LoadedImage(pixels_sha256(image), grid, rows, placeholder_count(grid, self.prep))

    def encode(self, png: bytes) -> int:
        loaded = self.load(png)
        model = self.engine.executor.runner.model  # type: ignore[attr-defined]
        return model.encode_image(torch.from_numpy(loaded.pixel_values), loaded.grid_thw).shape[0]

    def prompt(self, png: bytes) -> tuple[list[int], LoadedImage]:
        """The chat's ids with the picture's placeholders, and the picture as read."""
        loaded = self.load(png)
        ids, _ = self.reader.place(self.chat_ids, [loaded])
        return ids, loaded

    def first_token(self, png: bytes) -> int:
        """The whole way a chat's image goes: bytes to patches, placed in the ids, then one greedy token."""
        ids, placed = self.reader.place(self.chat_ids, [self.load(png)])
        request = replace(bench_requests([ids], 1)[0], images=placed)
        return self.engine.generate([request])[request.request_id].token_ids[0]


class TheirSide:
    """transformers' image processor and multimodal model (Qwen3_5ForConditionalGeneration)."""

    def __init__(self, checkpoint: Path, dtype: torch.dtype) -> None:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        self.processor = transformers.AutoImageProcessor.from_pretrained(checkpoint)
        self.model = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=dtype).eval()

    def patches(self, png: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.processor(images=[Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    @torch.inference_mode()
    def encode(self, png: bytes) -> int:
        pixels, grid = self.patches(png)
        features = self.model.get_image_features(pixel_values=pixels, image_grid_thw=grid)
        embeds = features.pooler_output if hasattr(features, "pooler_output") else features
        return sum(part.shape[0] for part in embeds)

    @torch.inference_mode()
    def first_token(self, png: bytes, ids: list[int]) -> int:
        pixels, grid = self.patches(png)
        input_ids = torch.tensor([ids])
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=(input_ids == self.model.config.image_token_id).int(),
            pixel_values=pixels,
            image_grid_thw=grid,
            max_new_tokens=1,
            do_sample=False,
        )
        return int(out[0, -1])


Side = tuple[Callable[[bytes], int], Callable[[bytes], int]]  # (encode, first token) from PNG bytes


def _measure(sides: list[Side], pngs: list[bytes]) -> list[Figures]:
    """Each side's figures over the pictures after pngs[0] (a warm-up); the sides take turns on every
    picture, so load from elsewhere on the machine falls on both alike."""
    figures = [Figures([], [], []) for _ in sides]
    for index, png in enumerate(pngs):
        for (encode, first), out in zip(sides, figures):
            encode_s, _ = _timed(lambda: encode(png))
            ttft_s, token = _timed(lambda: first(png))
            if index > 0:
                out.encode_s.append(encode_s)
                out.ttft_s.append(ttft_s)
                out.first_tokens.append(token)
    return figures


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)  # our engine and transformers alike
    width, height = (int(side) for side in args.image_size.lower().split("x"))
    pngs = [picture_png(seed, width, height) for seed in range(args.images + 1)]
    with tempfile.TemporaryDirectory() as scratch:
        dtype = "bfloat16" if args.dtype == "auto" else args.dtype
        checkpoint = Path(args.checkpoint) if args.checkpoint else bench_checkpoint(Path(scratch), args.size, dtype)
        ours = OurSide(checkpoint, args.dtype)
        try:
            model_dtype = getattr(torch, ours.engine.runner_info.dtype)
            theirs = TheirSide(checkpoint, model_dtype)
            ids, loaded = ours.prompt(pngs[0])
            _, their_grid = theirs.patches(pngs[0])
            if tuple(their_grid[0].tolist()) != loaded.grid_thw:
                raise RuntimeError(f"patch grids differ: ours {loaded.grid_thw}, transformers' {their_grid.tolist()}")
            mine, other = _measure(
                [
                    (ours.encode, ours.first_token),
                    (theirs.encode, lambda png: theirs.first_token(png, ids)),  # every picture: the same size
                ],
                pngs,
            )
        finally:
            ours.engine.shutdown()
    print(
        f"checkpoint: {checkpoint}  dtype {model_dtype}  threads {torch.get_num_threads()}  "
        f"image {width}x{height} -> grid {loaded.grid_thw}, {loaded.length} image tokens, prompt {len(ids)} tokens  "
        f"pictures {args.images} (median)  CPU kernels {cpu_native.level_name()}"
    )
    _print_table(width, height, mine, other)
    return 0


def _print_table(width: int, height: int, mine: Figures, other: Figures) -> None:
    print(f"{'figure':40} {'tensorfold':>12} {'transformers':>13} {'speedup':>8}")
    rows = [
        (f"encode ms per {width}x{height} image", mine.encode_s, other.encode_s),
        ("TTFT ms, one-image chat", mine.ttft_s, other.ttft_s),
    ]
    for label, ours, theirs in rows:
        a, b = statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3
        print(f"{label:40} {a:12.1f} {b:13.1f} {b / a:7.2f}x")
    agree = "agree" if mine.first_tokens == other.first_tokens else "DIFFER"
    print(f"{'greedy first tokens':40} {_ids(mine.first_tokens):>12} {_ids(other.first_tokens):>13} {agree:>8}")


def _ids(tokens: list[int]) -> str:
    return ",".join(str(token) for token in tokens)

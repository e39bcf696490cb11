"""Fixtures for image input: a tiny qwen3_5 checkpoint with a vision tower, and images made in memory."""

import base64
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
QWEN35_TEMPLATE = REPO.parent / "shared" / "fixtures" / "chat_templates" / "Qwen3.5-4B.jinja"


@pytest.fixture(scope="session")
def vision_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tensorfold fixture checkpoint DIR --arch qwen3_5`: the tiny multimodal checkpoint."""
    out = tmp_path_factory.mktemp("vision") / "qwen3_5"
    command = [sys.executable, "-m", "serve_app.cli", "fixture", "checkpoint", str(out), "--arch", "qwen3_5"]
    subprocess.run(command, check=True, capture_output=True)
    return out


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode if mode != "P" else "RGB"]
    pixels = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    image = Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode if mode != "P" else "RGB")
    return image.quantize(16) if mode == "P" else image


def encoded(image: Image.Image, fmt: str = "PNG", **save: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"

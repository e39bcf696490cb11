"""Pixels to the vision tower's patches, as transformers' Qwen2VLImageProcessor (PIL backend) makes them.

The image is resized (bicubic) so each side is a multiple of patch * merge and its area lies within the
checkpoint's min and max pixels, rescaled to [0, 1], normalised by mean and std, then cut into patch rows
ordered merge window by merge window; a still image is repeated over the temporal patch.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image


@dataclass(frozen=True)
class Preprocessing:
    """The checkpoint's preprocessor_config.json, as the patches need it."""

    patch_size: int  # pixels per patch side
    merge_size: int  # patches per side merged into one placeholder token
    temporal_patch_size: int  # frames per patch (a still image is repeated)
    min_pixels: int  # the resized image's least area (`size.shortest_edge`)
    max_pixels: int  # its greatest area (`size.longest_edge`)
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float = 1 / 255

    @classmethod
    def read(cls, checkpoint_dir: str | Path) -> "Preprocessing | None":
        """The config beside the weights; None where the checkpoint has none (no vision tower)."""
        path = Path(checkpoint_dir) / "preprocessor_config.json"
        if not path.is_file():
            return None
        raw = json.loads(path.read_text())
        size = raw.get("size") or {}
        return cls(
            patch_size=int(raw.get("patch_size", 14)),
            merge_size=int(raw.get("merge_size", 2)),
            temporal_patch_size=int(raw.get("temporal_patch_size", 2)),
            min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge", 56 * 56)),
            max_pixels=int(raw.get("max_pixels") or size.get("longest_edge", 28 * 28 * 1280)),
            image_mean=tuple(float(v) for v in raw.get("image_mean", (0.48145466, 0.4578275, 0.40821073))),
            image_std=tuple(float(v) for v in raw.get("image_std", (0.26862954, 0.26130258, 0.27577711))),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
        )

    @property
    def factor(self) -> int:
        """What each resized side is a multiple of: one merged window of patches."""
        return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, prep: Preprocessing) -> tuple[int, int]:
    """The resized (height, width): multiples of the factor, area within [min, max] pixels, aspect kept."""
    factor = prep.factor
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > prep.max_pixels:
        beta = math.sqrt((height * width) / prep.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < prep.min_pixels:
        beta = math.sqrt(prep.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _normalised(image: Image.Image, prep: Preprocessing) -> np.ndarray:
    """Channels first, float32: rescaled in float64 then cast, normalised in float32 (transformers' order)."""
    pixels = np.asarray(image, dtype=np.uint8).astype(np.float64) * prep.rescale_factor
    pixels = pixels.astype(np.float32)
    mean = np.array(prep.image_mean, dtype=np.float32)
    std = np.array(prep.image_std, dtype=np.float32)
    return np.moveaxis((pixels - mean) / std, -1, 0)


def _patchify(pixels: np.ndarray, prep: Preprocessing) -> tuple[np.ndarray, int, int]:
    """[C, H, W] to rows [grid_h * grid_w, C * temporal * patch * patch], merge window by merge window."""
    channels, height, width = pixels.shape
    patch, merge = prep.patch_size, prep.merge_size
    grid_h, grid_w = height // patch, width // patch
    patches = pixels.reshape(channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    patches = np.transpose(patches, (1, 4, 2, 5, 0, 3, 6))
    shape = (*patches.shape[:5], prep.temporal_patch_size, *patches.shape[5:])
    patches = np.broadcast_to(patches[:, :, :, :, :, None, :, :], shape)
    rows = patches.reshape(grid_h * grid_w, channels * prep.temporal_patch_size * patch * patch)
    return np.ascontiguousarray(rows, dtype=np.float32), grid_h, grid_w


def image_patches(image: Image.Image, prep: Preprocessing) -> tuple[tuple[int, int, int], np.ndarray]:
    """An RGB image's grid (t, h, w) in patches and its pixel rows (transformers' image_grid_thw, pixel_values)."""
    height, width = smart_resize(image.height, image.width, prep)
    resized = image.resize((width, height), Image.Resampling.BICUBIC)
    rows, grid_h, grid_w = _patchify(_normalised(resized, prep), prep)
    return (1, grid_h, grid_w), rows


def placeholder_count(grid_thw: tuple[int, int, int], prep: Preprocessing) -> int:
    """`<|image_pad|>` tokens an image takes: its patches over one merged window's."""
    t, h, w = grid_thw
    return t * h * w // (prep.merge_size**2)

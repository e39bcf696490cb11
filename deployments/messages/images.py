"""An image in a prompt, as the Renderer hands it on: decoded, preprocessed and placed (docs/vision.md).

The Renderer reads an image part (a `data:` URL, or an `https://` URL with `--vision-urls`), decodes it
with Pillow, resizes and normalises it as the checkpoint's preprocessor config says, cuts it into patches
and expands its one `<|image_pad|>` into `length` placeholder ids. Ingress carries the `ImageInput`s on the
`EngineRequest`; the Scheduler's engine encodes each distinct image once per request with the rank's
vision tower and writes the embeddings over its placeholder rows.
"""

from dataclasses import dataclass

import numpy as np


@dataclass
class ImageInput:
    """One image of a prompt (set by the Renderer; read by the router, the engine and the ranks)."""

    # SHA-256 of the decoded pixels (RGB, width and height, then the raw bytes): the image's name in the
    # prefix cache, the disk store and the router's keys, so equal placeholders with other pixels never match.
    sha256: bytes
    # The patch grid (temporal, height, width) in vision patches: transformers' `image_grid_thw` row.
    grid_thw: tuple[int, int, int]
    # The normalised patches, float32 [t * h * w, channels * temporal_patch * patch * patch]: transformers'
    # `pixel_values` rows for this image.
    pixel_values: np.ndarray
    offset: int  # the index in the prompt ids of its first placeholder (`<|image_pad|>`) token
    length: int  # its placeholder count: t * h * w / spatial_merge_size ** 2

    @property
    def end(self) -> int:
        return self.offset + self.length

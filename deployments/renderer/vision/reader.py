"""`ImageReader`: a request's image parts checked, read and cut into patches, then placed in its prompt ids.

`read` runs before the template: every refusal that needs no bytes first (vision off, a part in the wrong
role, too many images, a scheme this server does not read), then each image's bytes, decoding and patches.
`place` runs on the rendered ids: the template wrote one `<|image_pad|>` per image, in order; each becomes
its image's placeholder count, as transformers' processor expands it.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deployments.chat_format.conversation import IMAGES_OFF, MessageError
from deployments.config import ImageSettings
from deployments.messages.images import ImageInput
from deployments.renderer.vision.decode import DecodeError, decode_image, pixels_sha256
from deployments.renderer.vision.parts import IMAGE_ROLES, ImagePart, ImageRefusal, image_parts, template_messages
from deployments.renderer.vision.preprocess import Preprocessing, image_patches, placeholder_count
from deployments.renderer.vision.sources import ImageSources

IMAGE_PAD = "<|image_pad|>"


@dataclass
class LoadedImage:
    """One image read and preprocessed, waiting for its place in the ids."""

    sha256: bytes  # pixels_sha256 of the decoded RGB image
    grid_thw: tuple[int, int, int]
    pixel_values: np.ndarray
    length: int  # its placeholder count


def has_vision_tower(checkpoint_dir: str | Path) -> bool:
    """The checkpoint carries a vision tower and says how images become its patches."""
    config_path = Path(checkpoint_dir) / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    return "vision_config" in config and (Path(checkpoint_dir) / "preprocessor_config.json").is_file()


class ImageReader:
    """The Renderer's image side; `enabled` only with --vision, a vision tower and its placeholder token."""

    def __init__(
        self,
        settings: ImageSettings,
        prep: Preprocessing | None,
        pad_id: int | None,
        sources: ImageSources | None = None,
    ) -> None:
        self.settings = settings
        self.prep = prep
        self.pad_id = pad_id
        self.sources = sources or ImageSources(settings)

    @property
    def enabled(self) -> bool:
        return self.settings.vision and self.prep is not None and self.pad_id is not None

    def _off_reason(self) -> str:
        if not self.settings.vision:
            return IMAGES_OFF
        return "this model has no vision tower: it reads text only"

    def read(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[LoadedImage]]:
        """The messages as the template takes them, and their images in order; ImageRefusal naming the part."""
        parts = image_parts(messages)
        if not parts:
            return messages, []
        if not self.enabled:
            raise ImageRefusal(self._off_reason(), parts[0].field)
        for part in parts:
            if part.role not in IMAGE_ROLES:
                raise ImageRefusal(f"images are read in user and tool messages, not {part.role!r} ones", part.field)
        if len(parts) > self.settings.max_images:
            raise ImageRefusal(
                f"a request may carry at most {self.settings.max_images} images", parts[self.settings.max_images].field
            )
        for part in parts:
            self.sources.check(part)
        return template_messages(messages), [self._load(part) for part in parts]

    def _load(self, part: ImagePart) -> LoadedImage:
        assert self.prep is not None
        data = self.sources.read(part)
        try:
            image = decode_image(data, self.settings.max_image_pixels)
        except DecodeError as exc:
            raise ImageRefusal(str(exc), part.field) from None
        grid, rows = image_patches(image, self.prep)
        return LoadedImage(pixels_sha256(image), grid, rows, placeholder_count(grid, self.prep))

    def place(self, ids: list[int], images: list[LoadedImage]) -> tuple[list[int], list[ImageInput]]:
        """`ids` with each image's one placeholder expanded to its count, and the images with their spans."""
        pads = [index for index, token in enumerate(ids) if token == self.pad_id] if self.pad_id is not None else []
        if len(pads) != len(images):
            raise MessageError(
                f"the prompt holds {len(pads)} image placeholders for {len(images)} images: "
                f"the chat template does not place images, or the text contains {IMAGE_PAD}"
            )
        out: list[int] = []
        placed: list[ImageInput] = []
        start = 0
        for pad, image in zip(pads, images):
            out.extend(ids[start:pad])
            placed.append(ImageInput(image.sha256, image.grid_thw, image.pixel_values, len(out), image.length))
            out.extend([ids[pad]] * image.length)
            start = pad + 1
        out.extend(ids[start:])
        return out, placed

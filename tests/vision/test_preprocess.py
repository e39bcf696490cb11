"""Our preprocessing (Pillow + numpy) against transformers' image processor on the fixture's config: the same
grid, the same patch rows within float32 rounding, the same pixels after decoding each format."""

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from deployments.renderer.vision.decode import DecodeError, decode_image, pixels_sha256
from deployments.renderer.vision.preprocess import Preprocessing, image_patches, placeholder_count
from tests.vision.conftest import encoded, random_image

MAX_PIXELS = 40_000_000


def _gif(width: int, height: int) -> bytes:
    frames = [random_image(width, height, seed=s).quantize(32) for s in (1, 2)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=50)
    return buffer.getvalue()


CASES = {
    "tiny": lambda: encoded(random_image(3, 5)),  # below min_pixels: scaled up
    "odd": lambda: encoded(random_image(37, 23)),
    "fixture_example": lambda: encoded(random_image(52, 40)),
    "huge": lambda: encoded(random_image(640, 480)),  # past max_pixels: scaled down
    "tall": lambda: encoded(random_image(9, 300)),
    "jpeg": lambda: encoded(random_image(50, 30), "JPEG", quality=80),
    "webp": lambda: encoded(random_image(44, 28), "WEBP"),
    "gif_first_frame": lambda: _gif(33, 21),
    "png_alpha": lambda: encoded(random_image(30, 26, "RGBA")),
    "palette": lambda: encoded(random_image(27, 31, "P")),
    "grey": lambda: encoded(random_image(24, 24, "L")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_patches_equal_transformers(vision_checkpoint: Path, case: str) -> None:
    from transformers import AutoImageProcessor

    data = CASES[case]()
    prep = Preprocessing.read(vision_checkpoint)
    assert prep is not None
    grid, rows = image_patches(decode_image(data, MAX_PIXELS), prep)
    reference = AutoImageProcessor.from_pretrained(vision_checkpoint)(
        images=[Image.open(io.BytesIO(data))], return_tensors="np"
    )
    assert [list(grid)] == reference["image_grid_thw"].tolist()
    assert rows.dtype == np.float32 and rows.shape == reference["pixel_values"].shape
    np.testing.assert_allclose(rows, reference["pixel_values"], rtol=0, atol=1e-6)
    assert placeholder_count(grid, prep) == int(np.prod(grid)) // prep.merge_size**2


def test_config_reads_min_and_max_pixels(vision_checkpoint: Path) -> None:
    prep = Preprocessing.read(vision_checkpoint)
    assert prep is not None
    assert (prep.patch_size, prep.merge_size, prep.temporal_patch_size) == (4, 2, 2)
    assert (prep.min_pixels, prep.max_pixels) == (8 * 8, 64 * 64)
    _, rows = image_patches(random_image(640, 480), prep)
    assert rows.shape[0] * prep.patch_size**2 <= prep.max_pixels


def test_pixels_name_ignores_the_file_format() -> None:
    image = random_image(20, 12)
    png, webp = encoded(image), encoded(image, "WEBP", lossless=True)
    assert pixels_sha256(decode_image(png, MAX_PIXELS)) == pixels_sha256(decode_image(webp, MAX_PIXELS))
    other = random_image(20, 12, seed=5)
    assert pixels_sha256(decode_image(encoded(other), MAX_PIXELS)) != pixels_sha256(image)
    assert pixels_sha256(random_image(12, 20)) != pixels_sha256(image)


def test_decompression_bomb_refused_before_decoding() -> None:
    """A PNG that declares 100000 x 100000 pixels is refused from its header, before any pixel is decoded."""
    bomb = _declared_png(100_000, 100_000)
    with pytest.raises(DecodeError, match="more than the 40000000 pixels allowed"):
        decode_image(bomb, MAX_PIXELS)
    with pytest.raises(DecodeError, match="more than the 100 pixels allowed"):
        decode_image(encoded(random_image(20, 20)), 100)  # past twice the cap: Pillow's guard
    with pytest.raises(DecodeError, match="declares 12 x 10 pixels, more than the 100 allowed"):
        decode_image(encoded(random_image(12, 10)), 100)


def test_malformed_and_unsupported_bytes_refused() -> None:
    with pytest.raises(DecodeError, match="not a PNG, JPEG, WebP or GIF"):
        decode_image(b"plain text, not an image", MAX_PIXELS)
    with pytest.raises(DecodeError, match="not a PNG"):
        decode_image(encoded(random_image(8, 8), "BMP"), MAX_PIXELS)
    truncated = encoded(random_image(64, 64))[:200]
    with pytest.raises(DecodeError, match="malformed or truncated"):
        decode_image(truncated, MAX_PIXELS)
    with pytest.raises(DecodeError, match="differ at most 200 times"):
        decode_image(encoded(random_image(1, 300)), MAX_PIXELS)


def _declared_png(width: int, height: int) -> bytes:
    """A PNG signature and IHDR chunk declaring a huge canvas, with a tiny (invalid) body."""
    import struct
    import zlib

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + header
    ihdr = struct.pack(">I", len(header)) + chunk + struct.pack(">I", zlib.crc32(chunk))
    end = struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND"))
    return b"\x89PNG\r\n\x1a\n" + ihdr + end

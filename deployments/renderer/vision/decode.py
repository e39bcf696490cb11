"""An image's bytes to RGB pixels with Pillow, refusing what is not a still image of a supported format or is
too large, before its pixels are decoded (a small file may declare a huge canvas: a decompression bomb).
"""

import hashlib
import io
import struct
import warnings

from PIL import Image

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # GIF: its first frame
MAX_ASPECT_RATIO = 200  # the image processor refuses images more elongated than this


class DecodeError(ValueError):
    """Bytes that are not an image this server reads (the message says why)."""


def _opened(data: bytes, max_pixels: int) -> Image.Image:
    """Opened (header only), its format and declared size checked."""
    # Pillow's own guard (an error past twice the limit) backs up the check below, which names the size.
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:
        raise DecodeError(f"the image declares more than the {max_pixels} pixels allowed") from None
    except Exception:
        raise DecodeError("the data is not a PNG, JPEG, WebP or GIF image") from None
    width, height = image.size
    if width * height > max_pixels:
        raise DecodeError(f"the image declares {width} x {height} pixels, more than the {max_pixels} allowed")
    if min(width, height) < 1 or max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise DecodeError(f"the image is {width} x {height}: its sides may differ at most {MAX_ASPECT_RATIO} times")
    return image


def _rgb(image: Image.Image) -> Image.Image:
    """RGB as the image processor converts: transparency composited over white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """The image's first frame in RGB; DecodeError for anything else."""
    image = _opened(data, max_pixels)
    try:
        image.seek(0)
        image.load()
        return _rgb(image)
    except Exception:
        raise DecodeError("the image data is malformed or truncated") from None


def pixels_sha256(image: Image.Image) -> bytes:
    """The image's name: SHA-256 over b"RGB", its width and height (big-endian uint32 each), then the raw
    RGB bytes row by row. Equal pixels give equal names whatever file format carried them."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    digest = hashlib.sha256(b"RGB")
    digest.update(struct.pack(">II", rgb.width, rgb.height))
    digest.update(rgb.tobytes())
    return digest.digest()

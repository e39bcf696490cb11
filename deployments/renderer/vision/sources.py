"""An image part's bytes: a `data:` URL decoded from base64, or an `https://` URL fetched (with vision_urls).

Each refusal is its own sentence, so a client reads which rule its part broke.
"""

import base64
import binascii
import re

from deployments.config import ImageSettings
from deployments.renderer.vision.fetch import FetchError, UrlFetcher
from deployments.renderer.vision.parts import ImagePart, ImageRefusal

MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")
_SCHEME = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]{0,31}):")
_DATA_URL = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(;[^;,]*)*),(?P<data>.*)", re.DOTALL)


def read_data_url(url: str, max_bytes: int) -> bytes:
    """The bytes of `data:image/...;base64,...`; ValueError naming what is wrong."""
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise ValueError("a data: URL must read data:<media type>;base64,<data>")
    media_type = match["type"].strip().lower()
    if media_type not in MEDIA_TYPES:
        raise ValueError(f"unsupported image type {media_type or 'none'!r}: send PNG, JPEG, WebP or GIF")
    if ";base64" not in match["params"].lower():
        raise ValueError("a data: URL's image must be base64-encoded (data:<media type>;base64,<data>)")
    data = match["data"].strip()
    if len(data) // 4 * 3 > max_bytes + 3:  # refuse before decoding what cannot fit
        raise ValueError(f"the image is larger than {max_bytes} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the data: URL's base64 data is malformed") from None
    if len(raw) > max_bytes:
        raise ValueError(f"the image is larger than {max_bytes} bytes")
    return raw


class ImageSources:
    """Where a part's bytes come from, under the server's settings."""

    def __init__(self, settings: ImageSettings, fetcher: UrlFetcher | None = None) -> None:
        self.settings = settings
        self.fetcher = fetcher or UrlFetcher(
            max_bytes=settings.max_image_bytes,
            connect_timeout_s=settings.image_connect_timeout_s,
            read_timeout_s=settings.image_read_timeout_s,
        )

    def check(self, part: ImagePart) -> None:
        """The scheme is one this server reads (before any image is fetched or decoded)."""
        match = _SCHEME.match(part.url)
        scheme = match[1].lower() if match else ""
        if scheme == "data":
            return
        if scheme == "https" and self.settings.vision_urls:
            return
        if scheme == "https":
            raise ImageRefusal(
                "image URLs are off on this server (start it with --vision-urls); send a data: URL", part.field
            )
        raise ImageRefusal(
            f"unsupported image URL scheme {scheme or 'none'!r}: send a data: URL"
            + (" or an https:// URL" if self.settings.vision_urls else ""),
            part.field,
        )

    def read(self, part: ImagePart) -> bytes:
        """The part's bytes; ImageRefusal naming its field for every reason it cannot be read."""
        self.check(part)
        try:
            if part.url[:5].lower() == "data:":
                return read_data_url(part.url, self.settings.max_image_bytes)
            return self.fetcher.fetch(part.url)
        except (ValueError, FetchError) as exc:
            raise ImageRefusal(str(exc), part.field) from None

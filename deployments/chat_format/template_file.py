"""`--chat-template FILE`: read once at startup, checked before the engine opens, never a silent fallback."""

from pathlib import Path

from deployments.chat_format.template import ChatTemplate

MAX_TEMPLATE_BYTES = 16 * 1024 * 1024


def load_template_file(path: str | Path) -> str:
    """The template text (relative paths from the working directory); ValueError says why it is unusable.

    An empty file is valid and returns "": chat rendering is then unavailable, as with no template.
    """
    file = Path(path).expanduser()
    try:
        size = file.stat().st_size
        if size > MAX_TEMPLATE_BYTES:
            raise ValueError(f"chat template {file}: {size} bytes is over the 16 MiB limit")
        text = file.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ValueError(f"chat template {file}: cannot read it ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"chat template {file}: not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    if not text.strip():
        return ""
    ChatTemplate(text)  # compiles it now: a malformed template fails startup
    return text

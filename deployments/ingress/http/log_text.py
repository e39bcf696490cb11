"""Client-controlled text as a log line may hold it: one line, no terminal escapes (docs/api.md, The finish log).

A decoded path, a method, a model name or a value quoted in a refusal can carry `%0A` / `%0D` (a forged log
line) or `%1b` (a terminal escape). Every character `str.isprintable` refuses (controls, line and paragraph
separators, unassigned code points) is written as its Python escape, and a backslash as two, so a logged
`\\n` is always the four characters a client sent and never a line break.
"""

LOGGED_CHARS = 1000  # of a refusal's message: enough to read why; a quoted 16 MiB value stays out of the log


def escaped(text: str, limit: int | None = None) -> str:
    """`text` with every unprintable character escaped, cut to `limit` characters first (None: whole)."""
    if limit is not None and len(text) > limit:
        text = text[:limit] + "..."
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(_escape(ch) for ch in text)


def _escape(ch: str) -> str:
    if ch == "\\":
        return "\\\\"
    if ch.isprintable():
        return ch
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"

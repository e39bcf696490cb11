"""API keys: where they come from, how they are kept (SHA-256 digests with labels), and the key file.

Sources add together: repeated `--api-key` (labels `cli-N`), comma-separated `TENSORFOLD_API_KEY`
(`env-N`) and `--api-key-file` (one key per line, optional `label: key`, `#` comments; unnamed lines get
`file-N`). Only digests cross process boundaries: a replica's constructor arguments are visible in
Ray's dashboard and state API, so raw keys must never travel in them.
"""

import hashlib
import hmac
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from deployments.config import AuthSettings, KeyEntry

ENV_VAR = "TENSORFOLD_API_KEY"
LABEL_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MAX_KEY_FILE_BYTES = 1 << 20  # a key file is a few lines; refuse to read anything resembling a data file


class KeyFileError(ValueError):
    """The key file cannot be used: unreadable, too open, empty or malformed (the message says which)."""


def digest_of(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def check_label(label: str) -> str:
    if not LABEL_RE.match(label):
        raise ValueError(f"key label {label[:80]!r}: use at most 64 letters, digits, dots, underscores or hyphens")
    return label


def _entry(label: str, key: str) -> KeyEntry:
    key = key.strip()
    if not key:
        raise ValueError(f"key {label!r} is empty")
    if any(ch.isspace() for ch in key):
        raise ValueError(f"key {label!r} contains whitespace")
    return KeyEntry(label=check_label(label), digest=digest_of(key))


def entries_from_cli(keys: list[str]) -> list[KeyEntry]:
    return [_entry(f"cli-{i}", key) for i, key in enumerate(keys, start=1)]


def entries_from_env(value: str | None) -> list[KeyEntry]:
    """`TENSORFOLD_API_KEY=a,b`: empty items (a trailing comma) are skipped, not errors."""
    if not value:
        return []
    keys = [part.strip() for part in value.split(",") if part.strip()]
    return [_entry(f"env-{i}", key) for i, key in enumerate(keys, start=1)]


def parse_key_file(text: str) -> list[KeyEntry]:
    """The file's entries; a malformed line raises naming its line number, never its content."""
    entries: list[KeyEntry] = []
    unnamed = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        label, sep, key = line.partition(":")
        if not sep:
            unnamed += 1
            label, key = f"file-{unnamed}", line
        try:
            entries.append(_entry(label.strip(), key))
        except ValueError as exc:
            raise KeyFileError(f"line {number}: {exc}") from None
    if not entries:
        raise KeyFileError("the key file holds no keys")
    labels = [e.label for e in entries]
    if len(set(labels)) != len(labels):
        raise KeyFileError("the key file repeats a label; each label must name one key")
    return entries


@dataclass(frozen=True)
class FileStamp:
    """What tells a replaced file from the one already loaded (an atomic rename changes the inode)."""

    mtime_ns: int
    size: int
    inode: int


def stamp_of(path: Path) -> FileStamp:
    info = path.stat()
    return FileStamp(info.st_mtime_ns, info.st_size, info.st_ino)


def read_key_file(path: Path) -> list[KeyEntry]:
    """Read and check the key file: owner-only permissions, bounded size, at least one valid key."""
    try:
        with open(path, "rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise KeyFileError(
                    f"{path} is accessible by group or others (mode {stat.S_IMODE(mode):04o}); run: chmod 600 {path}"
                )
            data = handle.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read the key file ({exc.strerror or exc})") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"{path} is larger than {MAX_KEY_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise KeyFileError(f"{path} is not UTF-8 text") from None
    try:
        return parse_key_file(text)
    except KeyFileError as exc:
        raise KeyFileError(f"{path}: {exc}") from None


class KeySet:
    """The accepted digests. `match` hashes the presented key once and compares it with every digest."""

    def __init__(self, entries: list[KeyEntry]) -> None:
        self._entries = [(e.label, bytes.fromhex(e.digest)) for e in entries]

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, presented: str) -> str | None:
        """The label of the key presented, or None. No early exit, so timing says nothing of which matched."""
        probe = hashlib.sha256(presented.encode("utf-8", "surrogatepass")).digest()
        found: str | None = None
        for label, digest in self._entries:
            if hmac.compare_digest(probe, digest) and found is None:
                found = label
        return found


def auth_settings(api_keys: list[str], key_file: str | None, metrics_open: bool, env_value: str | None) -> AuthSettings:
    """Startup: digest the fixed keys and check the key file now, so a bad file refuses to start."""
    fixed = entries_from_cli(api_keys) + entries_from_env(env_value)
    path: str | None = None
    if key_file is not None:
        resolved = Path(key_file).expanduser().resolve()
        file_labels = {e.label for e in read_key_file(resolved)}
        clash = file_labels & {e.label for e in fixed}
        if clash:
            raise KeyFileError(f"{resolved}: label(s) {sorted(clash)} also used by --api-key or {ENV_VAR}")
        path = str(resolved)
    return AuthSettings(fixed=fixed, key_file=path, metrics_open=metrics_open)

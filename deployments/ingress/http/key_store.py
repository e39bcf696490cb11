"""One replica's live key set: the fixed keys plus the key file, re-read when the file is replaced.

The file's stamp (mtime, size, inode) is checked at most once a second, on the request path (one
`stat`). A reload request (SIGHUP to `tensorfold serve`, or `tensorfold reload-keys`) calls every Ingress
replica's `reload_keys` through Serve's handle broadcast, which re-reads the file at once.
A file that becomes empty, unreadable or malformed closes authenticated routes until a valid one returns.
"""

import logging
import time
from collections.abc import Callable
from pathlib import Path

from deployments.ingress.http.keys import AuthSettings, FileStamp, KeyFileError, KeySet, read_key_file, stamp_of

log = logging.getLogger("tensorfold.auth")
CHECK_INTERVAL_S = 1.0


class KeyStore:
    def __init__(self, settings: AuthSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._clock = clock
        self._path = Path(settings.key_file) if settings.key_file else None
        self._keys: KeySet | None = KeySet(list(settings.fixed))
        self._stamp: FileStamp | None = None
        self._checked_at = float("-inf")
        self.problem: str | None = None  # why authenticated routes are closed; None while they are open
        if self._path is not None:
            self.reload()

    @property
    def enabled(self) -> bool:
        return self._settings.enabled

    def keys(self) -> KeySet | None:
        """The accepted keys, after at most one `stat` a second; None while the key file is unusable."""
        if self._path is not None and self._clock() - self._checked_at >= CHECK_INTERVAL_S:
            self._check_file()
        return self._keys

    def _check_file(self) -> None:
        self._checked_at = self._clock()
        try:
            stamp = stamp_of(self._path)  # type: ignore[arg-type]
        except OSError:
            stamp = None
        if stamp is None or stamp != self._stamp:
            self.reload()

    def reload(self) -> str:
        """Re-read the key file now (startup, a changed stamp, or a reload request); says what happened."""
        if self._path is None:
            return "no key file configured"
        self._checked_at = self._clock()
        try:
            stamp = stamp_of(self._path)
            entries = read_key_file(self._path)
        except (OSError, KeyFileError) as exc:
            self._stamp = None
            self._keys = None
            if self.problem != str(exc):
                log.error("authenticated routes closed: %s", exc)
            self.problem = str(exc)
            return f"closed: {exc}"
        self._stamp = stamp
        self._keys = KeySet(list(self._settings.fixed) + entries)
        if self.problem is not None:
            log.warning("key file valid again; authenticated routes reopened")
        self.problem = None
        labels = ", ".join(e.label for e in entries[:20])
        log.info("loaded %d key(s): %s", len(self._keys), labels)
        return f"loaded {len(self._keys)} key(s): {labels}"


def request_reload(app_name: str, timeout_s: float = 10.0) -> list[str]:
    """Make every Ingress replica of `app_name` re-read its key file now (Serve's handle broadcast);
    returns each replica's outcome line. Needs a connected Ray driver (ray.init)."""
    from ray import serve

    handle = serve.get_deployment_handle("Ingress", app_name)
    return list(handle.broadcast("reload_keys").results(timeout_s=timeout_s))

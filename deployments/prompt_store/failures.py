"""Store failures, counted by reason and logged once per burst (docs/store.md "When the store fails").

A full disk fails every write until room comes back: one WARNING names the reason when a burst starts (and
again each REMIND_S while it lasts, with the count since), one INFO line when calls succeed again, never a
traceback per call. Used by the store's files (write failures) and by the engine's side of the link (an
actor that does not answer).
"""

import errno
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("tensorfold.store")
REMIND_S = 60.0  # a burst that lasts is said again this often, never per call

# The reasons a write fails, as /metrics labels them (store_write_failures_total{reason}).
NO_SPACE, PERMISSION, IO_ERROR, UNAVAILABLE = "no_space", "permission", "io_error", "unavailable"
WRITE_FAILURE_REASONS = (NO_SPACE, PERMISSION, IO_ERROR, UNAVAILABLE)
_REASONS = {
    errno.ENOSPC: NO_SPACE,
    errno.EDQUOT: NO_SPACE,
    errno.EFBIG: NO_SPACE,
    errno.EACCES: PERMISSION,
    errno.EPERM: PERMISSION,
    errno.EROFS: PERMISSION,
}


class StoreFailedError(RuntimeError):
    """A store call that failed: its actor did not answer (it restarts after a failure) or the disk refused.
    Its message is short and holds no actor id or process id (the engine logs it once per burst)."""


def failure_reason(exc: OSError) -> str:
    """The metric label of a failed disk operation: a full disk, a refused permission, else an I/O error."""
    if isinstance(exc, PermissionError):
        return PERMISSION
    return _REASONS.get(exc.errno or 0, IO_ERROR)


@dataclass
class FailureBurst:
    """Failures of one kind of call: `counts` by reason (kept for the life of the process), and whether a
    burst is under way (failures since the last success)."""

    what: str  # what failed, as the log line says it ("prompt store: writing")
    consequence: str  # what the failure costs ("states stay in RAM only")
    clock: Callable[[], float] = time.monotonic
    counts: dict[str, int] = field(default_factory=dict)
    in_burst: int = 0  # failures since the last success (0: no burst)
    _said_at: float = -REMIND_S  # when the burst was last logged (clock())
    _said_count: int = 0  # `in_burst` when it was last logged

    def failed(self, reason: str, detail: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.in_burst += 1
        now = self.clock()
        if self.in_burst == 1 or now - self._said_at >= REMIND_S:
            more = "" if self.in_burst == 1 else f" ({self.in_burst - self._said_count} more failures since)"
            log.warning("%s failed: %s (%s); %s%s", self.what, reason, detail, self.consequence, more)
            self._said_at, self._said_count = now, self.in_burst

    def succeeded(self) -> None:
        if self.in_burst:
            log.info("%s succeeds again after %d failures", self.what, self.in_burst)
            self.in_burst, self._said_count = 0, 0

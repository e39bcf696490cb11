"""Incremental detokenisation with stop strings: text never runs past a stop, even across chunks.

Stop strings are checked after every token on the whole generated text (reasoning included). The reply
ends at the token that completes a match and its text ends before the match. Text that might still turn
into a stop string is held back until it cannot.
"""

from collections.abc import Callable

_REPLACEMENT = "\ufffd"


class IncrementalText:
    """Turns reply token ids into text deltas (one per request, owned by its Sequence)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]) -> None:
        self._decode = decode
        self._stops = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0  # ids[prefix_offset:read_offset] decode to text already taken
        self._read_offset = 0
        self.text = ""  # all decoded reply text so far (before any stop cut)
        self._emitted = 0  # characters of `text` already handed out
        self.stopped_by: str | None = None  # the stop string that ended the reply

    def add_token(self, token_id: int) -> None:
        """Append one reply token; sets `stopped_by` when it completes a stop string."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if full.endswith(_REPLACEMENT) and len(full) > len(prefix):
            return  # an incomplete UTF-8 sequence: wait for the next token
        before = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self._stops and self.stopped_by is None:
            self._check_stops(before)

    def _check_stops(self, new_from: int) -> None:
        # Only a match ending in the new characters can be new; search the overlap window.
        start = max(0, new_from - self._hold)
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = self.text.find(stop, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            self.text = self.text[: best[0]]
            self.stopped_by = best[1]

    def take_delta(self, final: bool) -> str:
        """Text safe to send now; `final` releases what was held back for a possible stop."""
        end = len(self.text)
        if not final and self.stopped_by is None and self._stops:
            end = self._safe_end()
        end = max(end, self._emitted)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def flush_pending(self) -> None:
        """At the end of a reply, decode any bytes still waiting for a UTF-8 continuation."""
        if self._read_offset < len(self._ids) and self.stopped_by is None:
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            before = len(self.text)
            self.text += full[len(prefix) :]
            self._read_offset = len(self._ids)
            if self._stops:
                self._check_stops(before)

    def _safe_end(self) -> int:
        """The end of the text that no stop string can still claim."""
        text = self.text
        for k in range(min(self._hold, len(text)), 0, -1):
            tail = text[-k:]
            if any(stop.startswith(tail) for stop in self._stops):
                return len(text) - k
        return len(text)

"""The finish log (docs/api.md): one line per completed, refused or ended request, naming the client reply id;
and every logged client text made safe for a log line.

- completed: `finished <id> prompt=.. cached=.. thinking=.. effort=.. tokens=.. sha=.. finish=.. rounds=..
  drafts=accepted/drafted` (`-` when the reply was not drafted) (plus ttft and decode rate, which operators ask for first, and the replica that served it
  with the router's reason);
- refused:   `refused <id>: <message>`;
- ended:     `ended <id> reason=client-left|error: <message> prompt=.. tokens=.. elapsed=..s`.

Client-controlled text (a decoded path, a method, a model name, a value quoted in a refusal) can carry
`%0A` / `%0D` (a forged log line) or `%1b` (a terminal escape): `escaped` writes every character
`str.isprintable` refuses as its Python escape, and a backslash as two, in this log and the access log.
"""

import logging
import time

from deployments.ingress.usage import ReplySummary

log = logging.getLogger("tensorfold.requests")


def log_finished(request_id: str, summary: ReplySummary, finish: str, effort: str | None = None) -> None:
    stats = summary.stats
    ttft = summary.time_to_first_token
    log.info(
        "finished %s prompt=%d cached=%d thinking=%d effort=%s tokens=%d sha=%s finish=%s rounds=%d drafts=%s "
        "ttft=%s tps=%.1f replica=%s route=%s%s",
        request_id,
        stats.prompt_tokens,
        stats.cached_tokens,
        summary.reasoning_tokens,
        effort or "-",
        stats.completion_tokens,
        summary.sha[:16],
        finish,
        stats.rounds,
        "-" if stats.draft_method == "off" else f"{stats.accepted}/{stats.drafted}",
        "-" if ttft is None else f"{ttft:.3f}s",
        summary.tokens_per_second,
        stats.replica or "-",
        stats.route_reason or "-",
        ("" if stats.loop_period is None else f" loop=period:{stats.loop_period}")  # the loop guard closed it
        + ("" if not stats.disk_tokens else f" resumed=disk:{stats.disk_tokens}"),  # read back from the disk store
    )


def log_refused(request_id: str, status: int, message: str) -> None:
    """A request answered with an error before it ran; other server faults were logged as `ended`."""
    if status < 500 or status == 503:
        log.info("refused %s: %s", request_id, escaped(message, LOGGED_CHARS))  # it may quote the client


def log_ended(request_id: str, reason: str, prompt_tokens: int, tokens: int, arrival_time: float) -> None:
    elapsed = max(0.0, time.time() - arrival_time)
    reason = escaped(reason, LOGGED_CHARS)  # an error's text may quote the client
    log.info("ended %s reason=%s prompt=%d tokens=%d elapsed=%.3fs", request_id, reason, prompt_tokens, tokens, elapsed)


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

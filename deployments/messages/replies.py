"""What the engine sends back for each request: coalesced chunks, their logprob rows, the final figures.

Nothing here is HTTP-specific; Ingress frames the `EngineChunk`s for each API family and turns a `Refusal`
into the route's error. Fields say who sets them.
"""

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an end token, a stop token id or a stop string
    LENGTH = "length"  # the reply limit
    ABORT = "abort"  # the client left or the request was cancelled
    ERROR = "error"  # generation failed; `EngineChunk.error` says why


# The error a planned stop ends every request with (Ingress's drain asks each Scheduler replica to): a reply
# ended by it before its first token is a 503, which the client may send again.
SHUTTING_DOWN = "the server is shutting down"


@dataclass
class LogprobRow:
    """One reply token under the raw target distribution at temperature 1 (before any sampling cut)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (id, logprob) likeliest first, ties by lower id


@dataclass
class PromptLogprobRow:
    """One prompt token (the second onward) under the raw distribution the tokens before it give."""

    token_id: int  # the prompt token itself
    logprob: float
    rank: int  # vocabulary tokens whose logprob is at least this one's, itself included (vLLM's rank)
    top: list[tuple[int, float]] = field(default_factory=list)  # (id, logprob) likeliest first, ties by lower id


@dataclass
class ImprintAnswer:
    """What the imprint routes answer (docs/store.md); set by the engine, between rounds."""

    tokens: int  # the rendered prompt
    ram_tokens: int  # the longest kept state in RAM
    disk_tokens: int  # ... and on disk
    disk_bytes: int  # what reading the disk state past RAM's takes
    resume_from: str  # "ram", "disk" or "none"
    wait_seconds: float  # estimated wait before the first token: the read, then prefilling the rest
    disk: bool  # whether this server keeps states on disk
    loaded_tokens: int | None = None  # load only: tokens read into RAM now (0: RAM held as much, or not worth it)
    load_seconds: float | None = None


@dataclass
class RequestStats:
    """Figures for usage, the runtime block, metrics and the finish log (set by the engine at the end)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    completion_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None  # wall clock when the first reply token was drawn
    prefill_seconds: float = 0.0  # time spent in this request's prompt chunks
    decode_seconds: float = 0.0  # from the end of the prompt pass to the last token
    finish_time: float = 0.0
    preemptions: int = 0
    rounds: int = 0  # decode rounds this request took part in
    seed: int = 0  # the sampling key actually used
    prefill_widths: list[int] = field(default_factory=list)  # the chunk sizes its prompt was prefilled in
    loop_period: int | None = None  # the cycle length the loop guard closed, if it fired
    stop_string: str | None = None  # the stop string that ended the reply, if one did
    disk_tokens: int = 0  # of cached_tokens, those read back from the disk store for this request
    route_reason: str = ""  # the router's reason for this replica (the request's `route_reason`)
    replica: str = ""  # the Scheduler replica that served it (set by that replica on the last chunk)
    draft_method: str = "off"  # "mtp", "ngram" or "off" (the request asked for none, or the engine has none)
    drafted: int = 0  # draft tokens sent to verify rounds
    accepted: int = 0  # of those, kept (equal to the token the keyed draw gave at their row)
    draft_rounds: int = 0  # decode rounds that verified at least one draft
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts kept at draft position k
    pocket_version: int = 0  # living weights: the pocket version every token was computed with (0: the base)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Reply tokens each decode round wrote (the first token comes from the prompt pass): 1.0 serially."""
        return (self.completion_tokens - 1) / self.rounds if self.rounds and self.completion_tokens else 0.0


@dataclass
class EngineChunk:
    """Everything ready for one request since its last chunk (yielded by the Scheduler)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)  # new reply token ids
    text: str = ""  # their detokenised text (never past a stop string)
    finish_reason: FinishReason | None = None  # set on the last chunk only
    error: str | None = None  # with FinishReason.ERROR
    stats: RequestStats | None = None  # on the last chunk only
    # One row per id in token_ids when the request asked for logprobs (None otherwise); rows travel with
    # their tokens, so Ingress can send each with the text that completes it.
    logprobs: list[LogprobRow] | None = None
    # A scoring request's final chunk: the log-probability of each of its score_token_ids, in order.
    scores: list[float] | None = None
    # The first chunk after the prompt pass of a request that asked for prompt_logprobs (the final chunk of
    # one that ends before it): one row per prompt token after the first.
    prompt_logprobs: list[PromptLogprobRow] | None = None
    # A request's first chunk: its prompt tokens found in the prefix cache (known before the first token, so
    # a stream's opening usage carries the same split as its last).
    cached_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: "EngineChunk") -> None:
        """Fold a later chunk of the same request into this one (coalescing before a yield)."""
        self.token_ids.extend(later.token_ids)
        self.text += later.text
        if self.cached_tokens is None:
            self.cached_tokens = later.cached_tokens
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if later.scores is not None:
            self.scores = later.scores
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        if later.finish_reason is not None:
            self.finish_reason = later.finish_reason
            self.error = later.error
            self.stats = later.stats


@dataclass
class Refusal:
    """A request the server will not run, answered before any work: the engine's checks (the window, the
    prompt's ids, a grammar that does not compile, scoring), the Renderer's template and message errors and
    Ingress's own limits. It travels as a value; Ingress turns it into the route's error once."""

    message: str  # what the client reads
    param: str | None = None  # the request field it is about ("messages", "prompt", "response_format", ...)
    code: str | None = None  # e.g. "context_length_exceeded"; None for a plain invalid request
    status: int = 400  # the HTTP status
    type: str = "invalid_request_error"  # OpenAI's error type (the window's refusals: deployments/messages/window.py)

"""One request's whole reply from the offline `Engine.generate`: its chunks folded in order."""

from dataclasses import dataclass, field

from deployments.messages.replies import EngineChunk, FinishReason, LogprobRow, PromptLogprobRow, Refusal, RequestStats


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)  # the reply's ids
    text: str = ""  # their text (never past a stop string)
    finish_reason: FinishReason | None = None  # None while running, and for a refused request
    error: str | None = None  # with FinishReason.ERROR
    stats: RequestStats | None = None  # the last chunk's figures
    logprobs: list[LogprobRow] = field(default_factory=list)  # one row per reply token when the request asked
    prompt_logprobs: list[PromptLogprobRow] | None = None  # one row per prompt token after the first, if asked
    scores: list[float] | None = None  # a scoring request's log-probabilities of its score_token_ids
    chunks: int = 0  # how many chunks the engine sent (one per step that wrote something)
    refusal: Refusal | None = None  # why the engine did not run the request

    @property
    def settled(self) -> bool:
        return self.finish_reason is not None or self.refusal is not None

    def add(self, chunk: EngineChunk) -> None:
        self.chunks += 1
        self.token_ids.extend(chunk.token_ids)
        self.text += chunk.text
        self.logprobs.extend(chunk.logprobs or [])
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        if chunk.finished:
            self.finish_reason, self.error = chunk.finish_reason, chunk.error
            self.stats, self.scores = chunk.stats, chunk.scores

    def fail(self, message: str) -> None:
        """The engine's loop failed while this request ran (as the transports end every stream)."""
        self.finish_reason, self.error = FinishReason.ERROR, message

"""Admission: a new request's checks, its reply limit, and the Sequence the engine runs for it.

A request the engine cannot run is answered with a `Refusal` naming the request field it is about, before
any work: an empty prompt or an id outside the vocabulary, a prompt or reply limit past the window, a
grammar that does not compile, a scoring request it cannot honour, images without a vision tower or whose
placeholders do not match them. Label scoring reads the next-token
distribution after the prompt and writes no reply: the rank computes the float64 log-softmax of the
unmasked logits at the request's `score_token_ids` (sampler.score_row), and the engine ends the request
with those scores.
"""

import itertools

from deployments.config import EngineConfig
from deployments.messages.replies import Refusal
from deployments.messages.requests import EngineRequest
from deployments.messages.window import prompt_past_window, reply_past_window
from deployments.model_rank.sampler import derive_seed, seed_salt
from deployments.scheduler.engine.disk_states import DiskStates
from deployments.scheduler.engine.draft_rounds import DraftRounds
from deployments.scheduler.engine.grammar import GrammarBackend
from deployments.scheduler.engine.seq_images import image_refusal
from deployments.scheduler.engine.sequence import Sequence
from deployments.scheduler.engine.text_output import IncrementalText
from deployments.tokenizer import TokenizerBundle


class Admission:
    def __init__(
        self,
        config: EngineConfig,
        window: int,
        vocab_size: int,
        tokenizer: TokenizerBundle,
        grammars: GrammarBackend,
        drafts: DraftRounds | None,
        disk: DiskStates | None,
    ) -> None:
        self.config = config
        self.window = window  # the effective context window
        self.vocab_size = vocab_size  # the model's (prompt and score ids must be below it)
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.drafts = drafts  # None: the engine does not draft
        self.disk = disk  # None when the store is off
        self.salt = seed_salt()  # what a derived seed mixes in (TENSORFOLD_SEED_SALT)
        self._arrivals = itertools.count()
        self.image_token_id: int | None = None  # None: the ranks run no vision tower
        self.spatial_merge = 0

    def image_rules(self, image_token_id: int | None, spatial_merge: int) -> None:
        """What image placeholders look like on this model (None: images are refused)."""
        self.image_token_id, self.spatial_merge = image_token_id, spatial_merge

    def check(self, request: EngineRequest) -> Refusal | None:
        """Why the engine cannot run this request, or None (safe on any thread: it reads fixed facts and
        compiles a grammar under the backend's lock)."""
        refusal = self._prompt_refusal(request) or self._limit_refusal(request) or self._scoring_refusal(request)
        if refusal is None and (request.images or self.image_token_id is not None):
            refusal = image_refusal(request, self.image_token_id, self.spatial_merge)
        if refusal is None and request.prompt_logprobs is not None and request.prompt_logprobs < 0:
            refusal = Refusal("prompt_logprobs must be 0 or more", request.prompt_param)
        if refusal is None and request.grammar is not None:
            refusal = self.grammars.check(request.grammar)  # a 400 before any token
        return refusal

    def _prompt_refusal(self, request: EngineRequest) -> Refusal | None:
        if not request.prompt_token_ids:
            return Refusal("the prompt is empty", request.prompt_param)
        vocab = self.vocab_size
        bad = next((t for t in request.prompt_token_ids if t < 0 or t >= vocab), None)
        if bad is not None:
            return Refusal(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})", request.prompt_param)
        return prompt_past_window(self.window, len(request.prompt_token_ids), request.prompt_param)

    def _limit_refusal(self, request: EngineRequest) -> Refusal | None:
        prompt, limit = len(request.prompt_token_ids), request.max_tokens
        if limit is not None and limit < 0:
            return Refusal("max_tokens must be 0 or more", request.prompt_param)
        return reply_past_window(self.window, prompt, limit, request.prompt_param)

    def _scoring_refusal(self, request: EngineRequest) -> Refusal | None:
        ids = request.score_token_ids
        if ids is None:
            return None
        if not ids:
            return Refusal("score_token_ids is empty", request.prompt_param)
        bad = next((t for t in ids if t < 0 or t >= self.vocab_size), None)
        if bad is not None:
            message = f"score token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})"
            return Refusal(message, request.prompt_param)
        if request.grammar is not None or request.logprobs is not None:
            return Refusal("a scoring request cannot carry a grammar or ask for logprobs", request.prompt_param)
        return None

    def reply_limit(self, request: EngineRequest) -> int:
        """The reply limit: explicit, else the default, capped to the context the prompt leaves."""
        if request.max_tokens is not None:
            return request.max_tokens
        room = self.window - len(request.prompt_token_ids)
        return room if self.config.default_max_tokens is None else min(room, self.config.default_max_tokens)

    def sequence(self, request: EngineRequest) -> Sequence:
        """A checked request's Sequence, its prompt's disk state read back first where that pays."""
        sampling = request.sampling
        seed = sampling.seed if sampling.seed is not None else derive_seed(request.prompt_token_ids, self.salt)
        seq = Sequence(
            request=request,
            seed=seed,
            max_tokens=self.reply_limit(request),
            text=IncrementalText(self.tokenizer.decode, sampling.stop),
            arrival_order=next(self._arrivals),
            token_ids=list(request.prompt_token_ids),
        )
        seq.stats.prompt_tokens = len(request.prompt_token_ids)
        seq.stats.arrival_time = request.arrival_time
        seq.stats.seed = seed
        seq.stats.route_reason = request.route_reason
        seq.grammar = None if request.grammar is None else self.grammars.reply_grammar(request.grammar)
        seq.logprob_rows = None if request.logprobs is None else []
        seq.prompt_rows = None if request.prompt_logprobs is None else []
        if self.drafts is not None:
            self.drafts.start(seq)
        seq.stats.draft_method = "off" if seq.draft is None else seq.draft.method
        if self.disk is not None and not request.computes_whole_prompt:
            seq.stats.disk_tokens = self.disk.restore_prompt(request)
        return seq

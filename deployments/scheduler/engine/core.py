"""The engine a Scheduler replica wraps: admission, the step loop body, and each request's output.

Plain Python over the planner, block manager and executor; `EngineLoop` runs it on its own thread.
"""

import itertools
import logging
import time
from collections import deque
from pathlib import Path

from deployments.config import EngineConfig, StartupError
from deployments.messages.counters import EngineCounters
from deployments.messages.prefix import PrefixDigest
from deployments.messages.replies import ContextLengthError, EngineChunk, FinishReason
from deployments.messages.requests import EngineRequest
from deployments.messages.status import EngineInfo
from deployments.messages.step import Proposal, SeqStep, StepOutput, StepResult
from deployments.messages.store import StoreStats
from deployments.model_rank.executor import Executor, make_executor
from deployments.model_rank.runner import RunnerInfo, resolve_device
from deployments.model_rank.sampler import derive_seed, seed_salt
from deployments.scheduler.engine.disk_states import StoreLink
from deployments.scheduler.engine.draft_rounds import DraftRounds
from deployments.scheduler.engine.engine_disk import EngineDisk
from deployments.scheduler.engine.grammar import GrammarBackend, follow_written
from deployments.scheduler.engine.kv_blocks import BlockManager
from deployments.scheduler.engine.memory import (
    GIB,
    check_weights_fit,
    plan_pool,
    read_memory,
    read_mlx_memory,
    reserve_bytes,
)
from deployments.scheduler.engine.planner import PlannedStep, Planner
from deployments.scheduler.engine.scoring import check_scoring
from deployments.scheduler.engine.sequence import Sequence
from deployments.scheduler.engine.stats import LiveRates
from deployments.scheduler.engine.text_output import IncrementalText
from deployments.scheduler.engine.thinking import Forced, force_tokens
from deployments.tokenizer import TokenizerBundle, load_tokenizer

log = logging.getLogger("tensorfold.engine")
ENGINE_CALLS = frozenset({"imprint", "forget_disk"})  # what a driver may run on the engine between steps
DIGEST_INTERVAL_S = 0.25  # the router reads digests every second or so: rebuilding one per step is waste


class Engine(EngineDisk):
    def __init__(self, config: EngineConfig, store_link: StoreLink | None = None) -> None:
        self.config = config
        self.tokenizer: TokenizerBundle = load_tokenizer(config.model)
        self._check_weights_fit()
        self.executor: Executor = make_executor(config)
        runner = self.executor.info()
        self.runner_info = runner
        self.kv_budget_bytes = self._kv_budget(runner)  # what the KV pool may come out of (/memory reports it)
        model_window = runner.max_position_embeddings
        window = min(model_window, config.context) if config.context else model_window
        pool = plan_pool(
            budget_bytes=self.kv_budget_bytes,
            bytes_per_block=runner.kv_bytes_per_token * config.block_size,
            block_size=config.block_size,
            window=window,
            parallel=config.parallel,
            max_parallel_auto=config.max_parallel_auto,
        )
        self.executor.allocate_kv(pool.num_blocks, config.block_size)
        self.window = pool.window
        self.max_batch_size = pool.max_seqs
        bytes_per_block = runner.kv_bytes_per_token * config.block_size
        cached_cap = None if config.prompt_cache_gib is None else int(config.prompt_cache_gib * GIB) // bytes_per_block
        self.blocks = BlockManager(pool.num_blocks, config.block_size, cached_cap)
        self.counters = EngineCounters()
        self.disk = self._open_disk_states(store_link, runner) if config.learning else None
        self._digest_at, self._digest_version = 0.0, (-1, -1)  # the last digest handed to the router
        self._digests = 0
        self.draft_method = self._draft_method(runner)
        self.drafts = None if self.draft_method == "off" else DraftRounds(
            self.draft_method, config.draft_tokens, fixed=config.draft_policy == "fixed"
        )
        self.planner = Planner(self.blocks, pool.max_seqs, config.prefill_chunk_size, config.decode_share,
                               on_preempt=self._count_preemption, drafts=self.drafts)  # fmt: skip
        self.rates = LiveRates()
        self.eos_ids = set(self.tokenizer.eos_token_ids) | set(runner.eos_token_ids)
        self.salt = seed_salt()
        self.grammars = GrammarBackend(self.tokenizer, runner.vocab_size, sorted(self.eos_ids))
        self.policy = (
            f"parallel={pool.max_seqs} chunk={config.prefill_chunk_size} decode_share={config.decode_share} "
            f"threads={runner.threads} kv={pool.reason} drafts={self.draft_method}"
            + (f"x{self.drafts.max_drafts}" if self.drafts is not None else "")
        )
        self._arrivals = itertools.count()
        self._by_id: dict[str, Sequence] = {}
        self._outbox: deque[EngineChunk] = deque()
        self.last_step_kind: str | None = None  # "prefill" / "decode" / None: what the latest step ran
        log.info("engine ready: window=%d %s", self.window, self.policy)

    def _draft_method(self, runner: RunnerInfo) -> str:
        """The engine's drafter: the MTP layer where the ranks loaded one (auto, mtp), else n-gram lookup."""
        wanted = self.config.draft
        if wanted == "mtp" and not runner.mtp:
            raise StartupError(
                f"draft: mtp needs a checkpoint with an MTP layer (a glm4_moe model with num_nextn_predict_layers "
                f">= 1 and its model.layers.N weights); this {runner.model_type} checkpoint has none: "
                f"use --draft ngram, auto or off"
            )
        if wanted == "off":
            return "off"
        return "mtp" if runner.mtp else "ngram"

    def _check_weights_fit(self) -> None:
        files = sum(p.stat().st_size for p in Path(self.config.model).glob("*.safetensors"))
        check_weights_fit(files, resolve_device(self.config.device), self.config.tensor_parallel_size)

    def _kv_budget(self, runner: RunnerInfo) -> int:
        if self.config.kv_cache_gib is not None:
            return int(self.config.kv_cache_gib * GIB / self.config.tensor_parallel_size)
        import torch

        reading = read_mlx_memory() if runner.backend == "mlx" else read_memory(torch.device(runner.device))
        budget = reading.available_bytes - reserve_bytes(reading)
        if budget <= 0:
            raise StartupError(
                f"too little memory for the KV cache: {reading.available_bytes / GIB:.1f} GiB available after "
                f"loading the model, {reserve_bytes(reading) / GIB:.1f} GiB reserved (TENSORFOLD_MEMORY_RESERVE_GIB)"
            )
        # Ranks on one host share its memory.
        shares = self.config.tensor_parallel_size if reading.unified else 1
        return budget // shares

    # ---- admission ------------------------------------------------------------------------------------
    def resolve_max_tokens(self, request: EngineRequest) -> int:
        """The reply limit: explicit, else the default, capped to the context the prompt leaves."""
        prompt = len(request.prompt_token_ids)
        room = self.window - prompt
        if request.max_tokens is not None:
            return request.max_tokens
        limit = room if self.config.default_max_tokens is None else min(room, self.config.default_max_tokens)
        return limit

    def validate(self, request: EngineRequest) -> None:
        """Refuse what cannot fit, before any work (raises ContextLengthError)."""
        prompt = len(request.prompt_token_ids)
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.runner_info.vocab_size
        bad = next((t for t in request.prompt_token_ids if t < 0 or t >= vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if prompt >= self.window:
            raise ContextLengthError(self.window, prompt, None, request.prompt_param)
        if request.max_tokens is not None and request.max_tokens < 0:
            raise ValueError("max_tokens must be 0 or more")
        if request.max_tokens is not None and prompt + request.max_tokens > self.window:
            raise ContextLengthError(self.window, prompt, request.max_tokens, request.prompt_param)
        check_scoring(request, vocab)
        if request.prompt_logprobs is not None and request.prompt_logprobs < 0:
            raise ValueError("prompt_logprobs must be 0 or more")
        if request.grammar is not None:
            self.grammars.compile(request.grammar)  # a GrammarCompileError is a 400 before any token

    def add_request(self, request: EngineRequest) -> None:
        self.validate(request)
        if request.request_id in self._by_id:
            raise ValueError(f"request id {request.request_id!r} is already running")
        sampling = request.sampling
        seed = sampling.seed if sampling.seed is not None else derive_seed(request.prompt_token_ids, self.salt)
        seq = Sequence(
            request=request,
            seed=seed,
            max_tokens=self.resolve_max_tokens(request),
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
        if self.disk is not None and request.prompt_logprobs is None:
            seq.stats.disk_tokens = self._restore(request)
        self._by_id[request.request_id] = seq
        self.planner.add(seq)

    def abort_request(self, request_id: str) -> None:
        seq = self._by_id.get(request_id)
        if seq is not None:
            self._finish(seq, FinishReason.ABORT)

    def abort_all(self) -> None:
        for seq in list(self._by_id.values()):
            self._finish(seq, FinishReason.ERROR, "internal engine error")
        self._outbox.clear()

    # ---- the loop body --------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.planner.has_work() or bool(self._outbox)

    def step(self) -> list[EngineChunk]:
        """Plan and run one step; returns every chunk produced (at most one per request)."""
        planned = self.planner.schedule()
        self.last_step_kind = None if planned is None else planned.plan.kind
        if planned is not None:
            started = time.perf_counter()
            try:
                output = self.executor.execute(planned.plan)
            except Exception as exc:  # one failing step must not take the server down
                log.exception("step failed")
                self._fail(planned, f"generation failed: {exc}")
            else:
                seconds = time.perf_counter() - started
                self.planner.record(planned, seconds)
                self._apply(planned, output, seconds)
                if self.drafts is not None:
                    self.drafts.record_step(planned.plan.kind == "decode", planned.plan.num_tokens, seconds, output.mtp)
        chunks = list(self._outbox)
        self._outbox.clear()
        return chunks

    def _apply(self, planned: PlannedStep, output: StepOutput, seconds: float) -> None:
        now = time.time()
        drawn = iter(output.draws)
        is_prefill = planned.plan.kind == "prefill"
        new_tokens = written = 0
        for index, (seq, step) in enumerate(zip(planned.seqs, planned.plan.seqs)):
            results = [next(drawn) for _ in step.draws]
            if seq.prompt_rows is not None:
                seq.prompt_rows.extend(output.prompt_rows.get(index, []))
            seq.num_computed += len(step.new_token_ids) - step.num_drafts  # a draft's KV counts once it is kept
            self.blocks.register_full_blocks(seq.block_table, seq.token_ids, seq.num_computed)
            if is_prefill:
                seq.stats.prefill_seconds += seconds
                seq.stats.prefill_widths.append(len(step.new_token_ids))
                new_tokens += len(step.new_token_ids)
            else:
                seq.stats.rounds += 1
            if not results:
                continue
            if seq.request.score_token_ids is not None:
                self._scored(seq, results[0], now)
                continue
            if seq.max_tokens == 0:  # the prompt pass was the whole request (an echo scoring its prompt)
                seq.prompt_done_time = now
                self._finish(seq, FinishReason.LENGTH)
                continue
            before = seq.num_reply_tokens
            kept = self._accept_run(seq, step, results, now)
            written += seq.num_reply_tokens - before
            if self.drafts is not None:
                self.drafts.record(seq, step.num_drafts, kept)
                self._take_proposal(seq, output.proposals.get(index))
        if is_prefill:
            self.rates.prefill_pass(new_tokens, seconds)
            if self.disk is not None:
                self.disk.measured_prefill(new_tokens, seconds)
        else:
            self.counters.rounds_total += 1
            self.rates.decoded(written)

    def _accept_run(self, seq: Sequence, step: SeqStep, results: list[StepResult], now: float) -> int:
        """Write the round's draws in order while each kept the draft after it; returns the drafts kept.

        Each token goes through what a serial round does (forced closes, end tokens, stop strings, the
        limit, the grammar), so the first cut ends the run; the reply is sent once, after it.
        """
        drafts = step.new_token_ids[len(step.new_token_ids) - step.num_drafts :] if step.num_drafts else []
        DraftRounds.count_round(seq, len(drafts))
        kept = 0
        for i, result in enumerate(results):
            if i > 0:  # draft i equalled draw i - 1: its KV row is the reply's
                DraftRounds.count_kept(seq, kept)
                kept += 1
                seq.num_computed += 1
                self.blocks.register_full_blocks(seq.block_table, seq.token_ids, seq.num_computed)
            before = seq.num_reply_tokens
            if seq.logprob_rows is not None and result.logprobs is not None:
                seq.logprob_rows.append(result.logprobs)
            as_drawn = self._accept(seq, result.token, now)
            failure = follow_written(seq, before)  # the matcher follows every written token, forced too
            if failure is not None:
                self._finish(seq, FinishReason.ERROR, failure)
                break
            if not as_drawn or i == len(drafts) or result.token != drafts[i]:
                break
        if seq.finish_reason is None:
            self._emit(seq)
        return kept

    def _take_proposal(self, seq: Sequence, proposal: Proposal | None) -> None:
        """Keep the rank's MTP drafts when they continue the reply as written."""
        state = seq.draft
        if state is None or state.method != "mtp":
            return
        fits = (proposal is not None and seq.finish_reason is None and proposal.after == len(seq.token_ids) - 1
                and seq.token_ids[-1] == proposal.last_token)  # fmt: skip
        state.proposed = proposal.token_ids if fits and proposal is not None else []
        state.proposed_after = proposal.after if fits and proposal is not None else -1

    def _scored(self, seq: Sequence, result: StepResult, now: float) -> None:
        """A scoring request ends with its prompt pass: the drawn token is dropped, no reply token is written."""
        seq.prompt_done_time = now
        if result.scores is None:
            self._finish(seq, FinishReason.ERROR, "the model rank returned no scores")
            return
        seq.scores = result.scores
        self._finish(seq, FinishReason.STOP)

    def _accept(self, seq: Sequence, token: int, now: float) -> bool:
        """Write a drawn token (or what replaces it); True when it was written as drawn and the reply goes on."""
        if seq.num_reply_tokens == 0:
            seq.stats.first_token_time = now
            seq.prompt_done_time = now
        forced = force_tokens(seq.reply_token_ids, token, seq.request.thinking)
        if forced is not None:  # a thinking budget or the loop guard closes the think block
            self._write_forced(seq, forced)
            return False
        seq.token_ids.append(token)
        self.counters.completion_tokens_total += 1
        sampling = seq.request.sampling
        if token in sampling.stop_token_ids or (token in self.eos_ids and not sampling.ignore_eos):
            seq.text.flush_pending()
            self._finish(seq, FinishReason.STOP)
            return False
        seq.text.add_token(token)
        if seq.text.stopped_by is not None:
            self._finish(seq, FinishReason.STOP)
        elif seq.num_reply_tokens >= seq.max_tokens:
            seq.text.flush_pending()
            self._finish(seq, FinishReason.LENGTH)
        return seq.finish_reason is None

    def _write_forced(self, seq: Sequence, forced: Forced) -> None:
        """The forced close joins the reply like drawn tokens; the next step computes its KV."""
        if forced.loop_period is not None:
            seq.stats.loop_period = forced.loop_period
        for token in forced.token_ids:
            seq.token_ids.append(token)
            self.counters.completion_tokens_total += 1
            seq.text.add_token(token)
            if seq.text.stopped_by is not None:
                self._finish(seq, FinishReason.STOP)
                return
            if seq.num_reply_tokens >= seq.max_tokens:
                seq.text.flush_pending()
                self._finish(seq, FinishReason.LENGTH)
                return

    def _emit(self, seq: Sequence, final: bool = False) -> None:
        chunk = EngineChunk(
            request_id=seq.request_id,
            token_ids=seq.reply_token_ids[seq.delivered :],
            text=seq.text.take_delta(final),
            logprobs=None if seq.logprob_rows is None else seq.logprob_rows[seq.delivered :],
        )
        if seq.prompt_rows is not None and not seq.prompt_rows_sent:  # whole once the prompt pass ends
            chunk.prompt_logprobs, seq.prompt_rows_sent = seq.prompt_rows, True
        seq.delivered = seq.num_reply_tokens
        if chunk.token_ids or chunk.text or chunk.prompt_logprobs is not None or final:
            self._outbox.append(chunk)

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        if seq.finish_reason is not None:
            return
        seq.finish_reason = reason
        if self.disk is not None and reason in (FinishReason.STOP, FinishReason.LENGTH):
            chain = self.blocks.resident_chain(seq.block_table)  # before its blocks are released
            if not self.config.learn_conversations:  # --learn: only the prefix it shared with earlier requests
                chain = chain[: seq.stats.cached_tokens // self.config.block_size]
            self.disk.remember(chain)
        self.planner.remove(seq)
        self._by_id.pop(seq.request_id, None)
        stats = seq.stats
        stats.finish_time = time.time()
        stats.completion_tokens = seq.num_reply_tokens
        stats.stop_string = seq.text.stopped_by
        if seq.prompt_done_time is not None:
            stats.decode_seconds = stats.finish_time - seq.prompt_done_time
        self.counters.finished(stats, reason, seq.request.key_label)
        self._emit(seq, final=True)
        last = self._outbox[-1]
        last.finish_reason, last.error, last.stats = reason, error, stats
        last.scores = seq.scores

    def _fail(self, planned: PlannedStep, message: str) -> None:
        for seq in planned.seqs:
            self._finish(seq, FinishReason.ERROR, message)

    def _count_preemption(self, seq: Sequence) -> None:
        self.counters.preemptions_total += 1

    # ---- snapshots ------------------------------------------------------------------------------------
    def info(self) -> EngineInfo:
        running = list(self.planner.running)
        return EngineInfo(
            window=self.window,
            max_batch_size=self.max_batch_size,
            policy=self.policy,
            block_size=self.config.block_size,
            num_blocks=self.blocks.num_blocks,
            kv_usage=self.blocks.num_used / self.blocks.num_blocks,
            running=len(running),
            waiting=len(self.planner.waiting),
            decode_tokens_per_second=self.rates.decode_rate(),
            prefill_tokens_per_second=self.rates.prefill_rate(),
            dtype=self.runner_info.dtype,
            device=self.runner_info.device,
            device_name=self.runner_info.device_name,
            model_type=self.runner_info.model_type,
            counters=self.counters.snapshot(),
            prompt_cache=self.blocks.max_cached_blocks > 0,
            store=None if self.disk is None else self.disk.latest or StoreStats(),
            drafts=self.draft_method,
            draft_tokens=0 if self.drafts is None else self.drafts.max_drafts,
        )

    def fresh_digest(self, force: bool = False) -> PrefixDigest | None:
        """The resident blocks' keys for the router when they changed, at most every DIGEST_INTERVAL_S
        (`force`: whatever the interval, as the engine goes idle); else None."""
        now = time.monotonic()
        version = (self.blocks.version, 0 if self.disk is None else self.disk.version)
        if version == self._digest_version or (not force and now - self._digest_at < DIGEST_INTERVAL_S):
            return None
        self._digest_at, self._digest_version = now, version
        digest = self.blocks.digest()
        digest.version = self._digests = self._digests + 1  # RAM's or the disk's change: a new digest
        if self.disk is not None:  # what the node's disk store holds counts as a partial match
            digest.disk_keys = self.disk.disk_keys()
        return digest

    def shutdown(self) -> None:
        self.executor.shutdown()

"""The engine a Scheduler replica wraps: one model copy's requests, moved on by one loop body.

`run_once(inbox)` is that body, whichever transport drives it (deployments/scheduler/transports): it
answers the inbox's calls, admits its requests (a refusal is a value), applies its aborts, runs one step
when there is work, else one piece of idle work (disk writes), and returns what the turn produced as a
`Stepped`. `generate` runs it offline until every request settled (benchmarks, tests).
"""

import logging
from collections.abc import Callable, Iterable
from typing import Any

from deployments.config import EngineConfig, StartupError
from deployments.messages.counters import EngineCounters
from deployments.messages.engine_process import (
    CallAnswer,
    CallEnvelope,
    ClientLeft,
    EngineCall,
    ForgetDisk,
    Imprint,
    Inbox,
    MemorySnapshot,
    Stepped,
)
from deployments.messages.memory import ReplicaMemory
from deployments.messages.replies import EngineChunk, FinishReason, ImprintAnswer, Refusal
from deployments.messages.requests import EngineRequest, ImprintQuery
from deployments.messages.slide import SlideCall
from deployments.messages.status import EngineInfo
from deployments.messages.store import StoreUnavailable
from deployments.model_rank.executor import Executor, make_executor
from deployments.prompt_store.links import StoreLink
from deployments.scheduler.engine.admission import Admission
from deployments.scheduler.engine.completion import Completion
from deployments.scheduler.engine.disk_states import DiskStates
from deployments.scheduler.engine.draft_rounds import DraftRounds, draft_method
from deployments.scheduler.engine.grammar import GrammarBackend
from deployments.scheduler.engine.kv_blocks import BlockManager
from deployments.scheduler.engine.memory import (
    GIB,
    PoolPlan,
    check_checkpoint_fits,
    kv_budget,
    plan_pool,
    plan_states,
)
from deployments.scheduler.engine.planner import Planner
from deployments.scheduler.engine.reply_writer import ReplyWriter
from deployments.scheduler.engine.requests import Requests
from deployments.scheduler.engine.snapshots import Snapshots
from deployments.scheduler.engine.state_slots import StateSlots
from deployments.scheduler.engine.stepping import StepRunner
from deployments.scheduler.memory_report import replica_memory
from deployments.scheduler.slide.keeper import SlideKeeper
from deployments.tokenizer import TokenizerBundle, load_tokenizer

log = logging.getLogger("tensorfold.engine")


class Engine:
    def __init__(self, config: EngineConfig, store_link: StoreLink | None = None) -> None:
        """Load the model on its ranks and size the KV pool (`store_link`: the node's prompt store, needed
        when the config learns)."""
        self.config = config
        self.tokenizer: TokenizerBundle = load_tokenizer(config.model)
        self.executor: Executor = make_executor(config)  # the ranks measure their devices (memory.py)
        try:
            check_checkpoint_fits(config, self.executor.memory())
        except StartupError:
            self.executor.shutdown()
            raise
        self.executor.load()
        self.runner_info = self.executor.info()
        if config.vision and not self.runner_info.vision:
            raise ValueError(f"vision is on, but the {self.runner_info.backend} rank does not run a vision tower")
        self.kv_budget_bytes = kv_budget(config, self.executor.memory())  # what the pool may come out of (/memory)
        self.draft_method = draft_method(config.draft, self.runner_info)
        self.drafts = (
            None
            if self.draft_method == "off"
            else DraftRounds(self.draft_method, config.draft_tokens, fixed=config.draft_policy == "fixed")
        )
        pool = self._allocate_pool()
        self.window, self.lanes = pool.window, pool.lanes
        self.executor.warm_up(pool.lanes)  # on CUDA: every kernel compiled, the decode graphs captured
        self.counters = EngineCounters()
        self.disk = None if not config.learning else self._open_disk(store_link)
        self.policy = (
            f"lanes={pool.lanes} chunk={config.prefill_chunk_size} decode_share={config.decode_share} "
            f"threads={self.runner_info.threads} kv={pool.reason} drafts={self.draft_method}"
            + (f"x{self.drafts.max_drafts}" if self.drafts is not None else "")
        )
        self._build_parts()
        self.living = self._open_slide()
        weights = f"{self.runner_info.weights_format} {self.runner_info.weight_bytes / 1e6:.1f} MB"
        log.info("engine ready: window=%d weights=%s %s", self.window, weights, self.policy)

    def _allocate_pool(self) -> PoolPlan:
        """The KV pool on every rank and its block manager, as many blocks as the budget holds (after a
        hybrid model's state slots, which `self.states` keeps; None for an attention-only model)."""
        config, runner = self.config, self.runner_info
        model_window = runner.max_position_embeddings
        window = min(model_window, config.context) if config.context else model_window
        bytes_per_block = runner.kv_bytes_per_token * config.block_size
        cache_cap = None if config.prompt_cache_gib is None else int(config.prompt_cache_gib * GIB)
        budget, parallel, slots = self.kv_budget_bytes, config.parallel, None
        if runner.state_bytes_per_slot:
            slots = plan_states(
                budget_bytes=budget,
                slot_bytes=runner.state_bytes_per_slot,
                slots_per_lane=2 + (0 if self.drafts is None else self.drafts.max_drafts),
                kv_bytes_per_token=runner.kv_bytes_per_token,
                window=window,
                parallel=config.parallel,
                max_parallel_auto=config.max_parallel_auto,
                snapshot_cap_bytes=cache_cap,
            )
            budget, parallel = slots.kv_budget_bytes, slots.lanes
        pool = plan_pool(
            budget_bytes=budget,
            bytes_per_block=bytes_per_block,
            block_size=config.block_size,
            window=window,
            parallel=parallel,
            max_parallel_auto=config.max_parallel_auto,
        )
        snapshots = 0 if slots is None else min(slots.max_snapshots, pool.num_blocks)  # each names a block
        self.executor.allocate_kv(
            pool.num_blocks, config.block_size, 0 if slots is None else slots.num_slots(snapshots)
        )
        self.blocks = BlockManager(
            pool.num_blocks, config.block_size, None if cache_cap is None else cache_cap // bytes_per_block
        )
        self.states = None
        if slots is not None:
            num_slots = slots.num_slots(snapshots)
            self.states = StateSlots(num_slots, config.block_size, snapshots, config.state_snapshot_tokens)
        return pool

    def _open_disk(self, link: StoreLink | None) -> DiskStates:
        """The disk store's side of this engine (a hybrid model's snapshots go beside its KV rows)."""
        states = None if self.states is None else (self.states, self.executor.state_bytes_per_slot())  # all ranks
        return DiskStates.open(
            config=self.config,
            link=link,
            blocks=self.blocks,
            rows=self.executor,
            dtype=self.runner_info.dtype,
            device=self._compute_device(),
            states=states,
        )

    def _compute_device(self) -> str:
        """Where the ranks compute, as the disk store names it: on a GPU, its name and the projections' matmul."""
        runner = self.runner_info
        if not runner.device.startswith("cuda"):
            return runner.device
        return f"cuda:{runner.device_name}:{self.config.cuda_matmul}"

    def _open_slide(self) -> SlideKeeper | None:
        """Living weights (docs/slide.md), on the models whose rows the pocket can take alone."""
        if not self.config.slide:
            return None
        runner = self.runner_info
        if runner.backend != "torch" or runner.state_bytes_per_slot or runner.vision:
            raise StartupError(
                f"slide runs on attention-only text models on the torch backend; this is {runner.model_type} "
                f"on {runner.backend}" + (" with vision" if runner.vision else "")
            )
        return SlideKeeper(self.config, self.executor, runner.hidden_size, runner.num_layers, self.add_request)

    def _build_parts(self) -> None:
        """The parts a request meets, in order, around the one owner of its life (`self.requests`)."""
        config, runner, disk = self.config, self.runner_info, self.disk
        self.eos_ids = set(self.tokenizer.eos_token_ids) | set(runner.eos_token_ids)
        self.grammars = GrammarBackend(self.tokenizer, runner.vocab_size, sorted(self.eos_ids))
        self.requests = Requests(self.blocks, self.counters, self.states, disk, config.learn_conversations)
        self.admission = Admission(
            config, self.window, runner.vocab_size, self.tokenizer, self.grammars, self.drafts, disk
        )
        self.admission.image_rules(runner.image_token_id, runner.spatial_merge_size)
        planner = Planner(
            self.requests,
            self.blocks,
            self.lanes,
            config.prefill_chunk_size,
            config.decode_share,
            drafts=self.drafts,
            states=self.states,
            spatial_merge=runner.spatial_merge_size,
        )
        writer = ReplyWriter(self.eos_ids, self.counters)
        self.stepper = StepRunner(
            planner, self.executor, self.requests, writer, self.counters, self.drafts, self.states, disk
        )
        self.snapshots = Snapshots(
            self._fixed_info(), self.blocks, self.requests, self.stepper.rates, self.counters, disk, self.states
        )

    # ---- admission ------------------------------------------------------------------------------------
    def check(self, request: EngineRequest) -> Refusal | None:
        """Why the engine would refuse this request, or None (safe on any thread)."""
        return self.admission.check(request)

    def add_request(self, request: EngineRequest) -> Refusal | None:
        """Admit a request: its refusal, or None once it waits for a step (a request id already running is
        a fault, raised)."""
        refusal = self.admission.check(request)
        if refusal is not None:
            return refusal
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        version = 0 if self.living is None else self.living.version_for(request)
        if isinstance(version, Refusal):
            return version
        seq = self.admission.sequence(request)
        seq.stats.pocket_version = version
        self.requests.add(seq)
        return None

    def abort_request(self, request_id: str) -> None:
        self.requests.abort(request_id)

    # ---- the loop body --------------------------------------------------------------------------------
    def has_work(self) -> bool:
        """Requests in flight, or chunks not yet handed out."""
        return self.requests.has_work()

    def wants_step(self) -> bool:
        """Whether `run_once` has something to do with an empty inbox (idle disk writes included)."""
        return (
            self.has_work()
            or (self.disk is not None and self.disk.has_idle_work())
            or (self.living is not None and self.living.wants_turn())
        )

    def run_once(self, inbox: Inbox) -> Stepped:
        """One turn of the loop: the inbox's calls, adds and aborts, then one step or one piece of idle work."""
        out = Stepped(answers=[self._answer(envelope) for envelope in inbox.calls])
        for request in inbox.adds:
            self._admit(request, out)
        try:
            for request_id in inbox.aborts:
                self.abort_request(request_id)
            if self.has_work():
                ran = self.stepper.run()
                if ran is not None:
                    out.step_kind, out.step_seconds = ran.kind, ran.seconds
                out.chunks.extend(self.requests.take_chunks())
            elif not inbox and self.disk is not None and self.disk.has_idle_work():
                self.disk.idle_work()  # one piece to disk; a request arriving meanwhile waits for it alone
            if self.living is not None:
                self._slide_turn(out)
        except Exception:  # a bug in the loop body: end what is in flight rather than hang it
            log.exception("engine step failed; ending every request in flight")
            self.requests.abort_all("internal engine error")
            out.failed = "internal engine error"
        self.snapshots.take(out, busy=self.has_work())
        return out

    def _slide_turn(self, out: Stepped) -> None:
        """A slice of living weights' training; its capture requests' chunks stay here."""
        assert self.living is not None
        out.chunks = [chunk for chunk in out.chunks if not self.living.is_capture(chunk.request_id)]
        self.living.turn(self.requests.pocket_versions(), idle=not self.requests.has_requests())

    def _admit(self, request: EngineRequest, out: Stepped) -> None:
        """A refusal goes back as a value, before any chunk; any other fault ends only this request."""
        try:
            refusal = self.add_request(request)
        except Exception as exc:
            log.exception("could not add request %s", request.request_id)
            out.chunks.append(EngineChunk(request.request_id, finish_reason=FinishReason.ERROR, error=str(exc)))
            return
        if refusal is not None:
            out.refusals.append((request.request_id, refusal))

    def generate(
        self, requests: Iterable[EngineRequest], on_step: Callable[[Stepped], None] | None = None
    ) -> dict[str, Completion]:
        """Run requests offline: `run_once` until nothing is in flight (requests admitted before this call
        included). Every request's Completion, refused ones with their refusal; `on_step` sees each turn."""
        inbox = Inbox(adds=list(requests))
        completions = {request.request_id: Completion() for request in inbox.adds}
        while True:
            stepped = self.run_once(inbox)
            inbox = Inbox()
            if on_step is not None:
                on_step(stepped)
            for request_id, refusal in stepped.refusals:
                completions[request_id].refusal = refusal
            for chunk in stepped.chunks:
                completions.setdefault(chunk.request_id, Completion()).add(chunk)
            if stepped.failed is not None:
                for completion in completions.values():
                    if not completion.settled:
                        completion.fail(stepped.failed)
            if not self.has_work():
                return completions

    # ---- calls between steps --------------------------------------------------------------------------
    def _answer(self, envelope: CallEnvelope) -> CallAnswer:
        call = envelope.call
        try:
            value = self.answer(call)
            return CallAnswer(envelope.call_id, call.reply(value))
        except Exception as exc:  # the caller gets the error; the engine goes on
            log.exception("engine call %s failed", type(call).__name__)
            return CallAnswer(envelope.call_id, None, f"{type(exc).__name__}: {exc}")

    def answer(self, call: EngineCall[Any]) -> object:
        """A replica's typed call (messages/engine_process.py, messages/slide.py), answered between steps."""
        match call:
            case Imprint(query=query):
                return self.imprint(query)
            case ForgetDisk():
                return self.forget_disk()
            case MemorySnapshot(reset_peak=reset_peak):
                return self.memory(reset_peak)
            case ClientLeft():
                self.client_left()
            case SlideCall():
                return self.slide(call)
            case _:
                raise TypeError(f"not an engine call: {type(call).__name__}")
        return None

    def imprint(self, query: ImprintQuery) -> ImprintAnswer:
        """The imprint routes' answer for a rendered conversation (docs/store.md)."""
        assert self.disk is not None, "the imprint routes answer 404 unless learn_conversations is on"
        return self.disk.imprint(query)

    def slide(self, call: SlideCall[Any]) -> object:
        """A living-weights call from the Slide room (docs/slide.md)."""
        if self.living is None:
            raise ValueError("this server runs without slide")
        return self.living.answer(call)

    def forget_disk(self) -> int | StoreUnavailable:
        """DELETE /v1/imprint: bytes freed on this engine's node (0 when another replica there did it first),
        or why its store did not delete."""
        return 0 if self.disk is None else self.disk.forget_all()

    def client_left(self) -> None:
        """A client that left its streamed reply before all of it went out (Ingress counts each once, whether
        the reply had finished here or was aborted): a disconnection (`requests_aborted_total`)."""
        self.counters.requests_aborted_total += 1

    def memory(self, reset_peak: bool = False) -> ReplicaMemory:
        """GET /memory's snapshot of this engine (the replica names itself)."""
        return replica_memory("", self, reset_peak)

    def finish_writes(self) -> None:
        """A planned stop: what waits for disk is written, and the store has it (disk_states.py)."""
        if self.disk is not None:
            self.disk.finish_writes()

    # ---- snapshots ------------------------------------------------------------------------------------
    def info(self) -> EngineInfo:
        """A snapshot for /health, /metrics and the finish log (snapshots.py)."""
        return self.snapshots.info()

    def memory_figures(self) -> dict[str, int]:
        return self.snapshots.memory_figures()

    def _fixed_info(self) -> EngineInfo:
        """What the snapshots report that never changes; the live figures start at zero."""
        runner = self.runner_info
        return EngineInfo(
            window=self.window,
            lanes=self.lanes,
            policy=self.policy,
            block_size=self.config.block_size,
            num_blocks=self.blocks.num_blocks,
            kv_usage=0.0,
            running=0,
            waiting=0,
            decode_tokens_per_second=0.0,
            prefill_tokens_per_second=0.0,
            dtype=runner.dtype,
            device=runner.device,
            device_name=runner.device_name,
            model_type=runner.model_type,
            weights_format=runner.weights_format,
            weights_bytes=runner.weight_bytes * self.config.tensor_parallel_size,
            counters=EngineCounters(),
            prompt_cache=self.blocks.max_cached_blocks > 0,
            drafts=self.draft_method,
            draft_tokens=0 if self.drafts is None else self.drafts.max_drafts,
            state_slots=0 if self.states is None else self.states.num_slots,
        )

    def shutdown(self) -> None:
        self.executor.shutdown()

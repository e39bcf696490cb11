"""The engine's side of the disk prompt-state store: restoring prompts, the imprint routes' calls, idle writes.

A mixin of `Engine` (kept apart so the engine file stays the step loop); `self.disk` is None when the store is off.
"""

import logging
import time

from deployments.config import EngineConfig
from deployments.messages.prefix import PromptHashes
from deployments.messages.replies import ImprintAnswer
from deployments.messages.requests import EngineRequest, ImprintQuery
from deployments.model_rank.executor import Executor
from deployments.model_rank.runner import RunnerInfo
from deployments.prompt_store.identity import CONVERSATIONS, PREFIXES, set_id
from deployments.prompt_store.links import STORE_FLUSH_S
from deployments.scheduler.engine.disk_states import DiskStates, StoreLink
from deployments.scheduler.engine.kv_blocks import BlockManager

log = logging.getLogger("tensorfold.engine")
STOP_WRITES_S = 15.0  # of the manual's 20 s for a planned stop: the replica flushes the store actor after


class EngineDisk:
    config: EngineConfig
    disk: DiskStates | None
    blocks: BlockManager
    executor: Executor

    def _restore(self, request: EngineRequest) -> int:
        """Tokens of the prompt read back from disk (0 when RAM holds as much, a read does not pay, or it fails)."""
        assert self.disk is not None
        hashes = request.prompt_hashes or PromptHashes.of(request.prompt_token_ids, self.config.block_size)
        try:
            return self.disk.restore(request.prompt_token_ids, hashes)
        except Exception:  # the store failing costs a prompt pass, never the request
            log.exception("prompt store: restoring failed; prefilling instead")
            return 0

    def imprint(self, query: ImprintQuery) -> ImprintAnswer:
        """The imprint routes' answer for a rendered conversation (loading its disk state first if asked)."""
        assert self.disk is not None, "the imprint routes answer 404 unless learn_conversations is on"
        prompt = query.prompt_token_ids
        hashes = query.prompt_hashes or PromptHashes.of(prompt, self.config.block_size)
        if not query.load:
            return self.disk.answer(prompt, hashes)
        started = time.perf_counter()
        loaded = self.disk.restore(prompt, hashes)
        answer = self.disk.answer(prompt, hashes)
        answer.loaded_tokens, answer.load_seconds = loaded, round(time.perf_counter() - started if loaded else 0.0, 6)
        return answer

    def forget_disk(self) -> int:
        """DELETE /v1/imprint: bytes freed on this engine's node (0 when another replica there did it first)."""
        return 0 if self.disk is None else self.disk.forget_all()

    def has_idle_work(self) -> bool:
        """States waiting for disk: written one piece per idle turn, so a new request waits for one piece."""
        return self.disk is not None and (self.disk.has_writes() or self.disk.stats_stale)

    def finish_writes(self) -> None:
        """A planned stop writes what is waiting, within STOP_WRITES_S, then waits for the store to have them
        (writes are sent without waiting: the process must not exit before the store has read them)."""
        deadline = time.monotonic() + STOP_WRITES_S
        while self.has_idle_work() and time.monotonic() < deadline:
            self.idle_work()
        if self.disk is not None:
            self.disk.link.flush(STORE_FLUSH_S)

    def idle_work(self) -> None:
        if self.disk is None:
            return
        try:
            if self.disk.has_writes():
                self.disk.write_one()
            else:  # after the writes: the store's figures for /metrics and /health
                self.disk.refresh_stats()
        except Exception:  # the store failing costs its states, never the engine: they stay in RAM only
            log.exception("prompt store: writing failed; states stay in RAM only")
            self.disk.stats_stale = False

    def _open_disk_states(self, link: StoreLink | None, runner: RunnerInfo) -> DiskStates:
        if link is None:
            raise ValueError("learn needs the node's prompt store")
        token_bytes = self.executor.kv_bytes_per_token()  # every rank's shard
        layout = f"{token_bytes}B-per-token"
        kind = CONVERSATIONS if self.config.learn_conversations else PREFIXES
        store_set = set_id(self.config.model, runner.dtype, f"{layout}/b{self.config.block_size}",
                           self.config.tensor_parallel_size, kind)  # fmt: skip
        block_bytes = token_bytes * self.config.block_size
        return DiskStates(link, store_set, self.blocks, self.executor, block_bytes)


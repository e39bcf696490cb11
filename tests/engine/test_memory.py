"""KV pool sizing: the reserves (docs/engine.md), explicit caps, lanes for `parallel: auto`, startup refusals,
all planned from the memory the ranks report (the engine never reads a device itself)."""

from pathlib import Path

import pytest
import torch

from deployments.config import EngineConfig, StartupError
from deployments.messages.memory import MemoryReading
from deployments.model_rank.executor import InProcessExecutor
from deployments.scheduler.engine import core
from deployments.scheduler.engine.memory import (
    GIB,
    check_checkpoint_fits,
    check_weights_fit,
    kv_budget,
    plan_pool,
    reserve_bytes,
)


def card(free_gib: float, index: int = 0, host: str = "node-a") -> MemoryReading:
    return MemoryReading(int(free_gib * GIB), 80 * GIB, unified=False, host=host, device=f"cuda:{index}")


def ram(free_gib: float, host: str = "node-a") -> MemoryReading:
    return MemoryReading(int(free_gib * GIB), 128 * GIB, unified=True, host=host, device="cpu")


def test_reserves_follow_the_manual(monkeypatch) -> None:
    monkeypatch.delenv("TENSORFOLD_MEMORY_RESERVE_GIB", raising=False)
    host = MemoryReading(available_bytes=100 * GIB, total_bytes=128 * GIB, unified=True)
    small_host = MemoryReading(available_bytes=10 * GIB, total_bytes=16 * GIB, unified=True)
    card = MemoryReading(available_bytes=70 * GIB, total_bytes=80 * GIB, unified=False)
    small_card = MemoryReading(available_bytes=7 * GIB, total_bytes=8 * GIB, unified=False)
    assert reserve_bytes(host) == int(12.8 * GIB)  # a tenth of RAM
    assert reserve_bytes(small_host) == 4 * GIB  # at least 4 GiB
    assert reserve_bytes(card) == int(2.5 * GIB)  # a 32nd of the card
    assert reserve_bytes(small_card) == 1 * GIB  # at least 1 GiB
    monkeypatch.setenv("TENSORFOLD_MEMORY_RESERVE_GIB", "3")
    assert reserve_bytes(host) == 3 * GIB
    monkeypatch.setenv("TENSORFOLD_MEMORY_RESERVE_GIB", "1")
    with pytest.raises(StartupError, match="at least 2"):
        reserve_bytes(host)
    assert reserve_bytes(card) == 1 * GIB
    monkeypatch.setenv("TENSORFOLD_MEMORY_RESERVE_GIB", "lots")
    with pytest.raises(StartupError, match="number of GiB"):
        reserve_bytes(card)


def test_pool_lanes_and_window() -> None:
    plan = plan_pool(
        budget_bytes=1000 * 64, bytes_per_block=64, block_size=16, window=4096, parallel="auto", max_parallel_auto=64
    )
    assert plan.num_blocks == 1000 and plan.lanes == 3  # 16000 tokens hold three 4096-token windows
    tight = plan_pool(
        budget_bytes=100 * 64, bytes_per_block=64, block_size=16, window=4096, parallel=4, max_parallel_auto=64
    )
    assert tight.window == 1600 and tight.lanes == 4  # the window shrinks to what the pool holds
    capped = plan_pool(
        budget_bytes=10**12, bytes_per_block=64, block_size=16, window=256, parallel=2, max_parallel_auto=64
    )
    assert capped.num_blocks == 2 * 2 * 16  # never more than every lane's window, twice
    with pytest.raises(StartupError, match="no memory left"):
        plan_pool(budget_bytes=10, bytes_per_block=64, block_size=16, window=256, parallel=1, max_parallel_auto=8)


def test_weights_that_cannot_fit_fail_startup() -> None:
    with pytest.raises(StartupError, match="too little memory for the model"):
        check_weights_fit(1 << 50, [ram(100)])
    check_weights_fit(1 << 20, [ram(100)])


def test_each_rank_must_hold_its_share_of_the_weights(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)
    config = EngineConfig(model=str(tmp_path), device="cuda", tensor_parallel_size=2)
    check_checkpoint_fits(config, [card(1), card(1, 1)])  # 2 KiB each
    with pytest.raises(StartupError, match=r"0\.00 GiB is available on cuda:1 \(rank 1\)"):
        check_checkpoint_fits(config, [card(1), card(1000 / GIB, 1)])
    # Two ranks on one host's memory hold the whole checkpoint between them.
    with pytest.raises(StartupError, match="rank 0"):
        check_weights_fit(4096, [ram(3000 / GIB), ram(3000 / GIB)])
    check_weights_fit(4096, [ram(3000 / GIB, "node-a"), ram(3000 / GIB, "node-b")])


def test_the_pool_budget_is_the_least_any_rank_reports(monkeypatch) -> None:
    monkeypatch.delenv("TENSORFOLD_MEMORY_RESERVE_GIB", raising=False)
    config = EngineConfig(model="unused", tensor_parallel_size=2)
    assert kv_budget(config, [card(40), card(30, 1)]) == int(27.5 * GIB)  # 30 less a 32nd of the card
    # Ranks on one host share its RAM (less one reserve); on two hosts each has its own.
    one_host = 100 * GIB - reserve_bytes(ram(100))  # less a tenth of the 128 GiB
    assert kv_budget(config, [ram(100), ram(100)]) == one_host // 2
    assert kv_budget(config, [ram(100), ram(100, "node-b")]) == one_host
    with pytest.raises(StartupError, match="KV cache \\(rank 1\\)"):
        kv_budget(config, [card(40), card(0.5, 1)])
    capped = EngineConfig(model="unused", tensor_parallel_size=2, kv_cache_gib=4)
    assert kv_budget(capped, [card(40), card(0.5, 1)]) == 2 * GIB


class CardRank(InProcessExecutor):
    """A rank computing on this CPU that reports a CUDA card: the memory a GPU rank would measure."""

    readings = [card(10), card(9)]  # before loading, after

    def memory(self) -> list[MemoryReading]:
        return [self.readings.pop(0)]

    def load(self) -> None:
        self.config = self.config.model_copy(update={"device": "cpu"})
        super().load()


def test_the_engine_plans_from_its_rank_reports_without_reading_a_device(random_glm_dir, monkeypatch) -> None:
    def no_cuda(*args, **kwargs):
        raise AssertionError("the engine read a CUDA device itself")

    monkeypatch.delenv("TENSORFOLD_MEMORY_RESERVE_GIB", raising=False)
    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda)
    monkeypatch.setattr(torch.cuda, "mem_get_info", no_cuda)
    monkeypatch.setattr(core, "make_executor", CardRank)
    engine = core.Engine(EngineConfig(model=str(random_glm_dir), device="cuda", dtype="float32", parallel=2))
    assert engine.kv_budget_bytes == int(6.5 * GIB)  # 9 GiB less a 32nd of the 80 GiB card
    CardRank.readings = [card(1e-6)]
    with pytest.raises(StartupError, match="available on cuda:0"):
        core.Engine(EngineConfig(model=str(random_glm_dir), device="cuda", dtype="float32"))

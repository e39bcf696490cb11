"""KV pool sizing: the reserves (docs/engine.md), explicit caps, lanes for `parallel: auto`, startup refusals."""

import pytest
import torch

from deployments.config import StartupError
from deployments.scheduler.engine.memory import GIB, MemoryReading, check_weights_fit, plan_pool, reserve_bytes


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
        check_weights_fit(1 << 50, torch.device("cpu"))
    check_weights_fit(1 << 20, torch.device("cpu"))

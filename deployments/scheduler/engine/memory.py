"""Sizing the KV pool from free memory less a reserve (the defaults: docs/config.md).

The memory figures come from the ranks (deployments/model_rank/device_memory.py): each rank reads its own
device and reports a `MemoryReading`; the engine plans from those reports alone, so the Scheduler replica
never touches a device (at tensor-parallel size above 1 it holds none)."""

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from deployments.config import EngineConfig, StartupError
from deployments.messages.memory import MemoryReading

GIB = 1 << 30


def reserve_bytes(reading: MemoryReading) -> int:
    """TENSORFOLD_MEMORY_RESERVE_GIB, else a tenth of RAM (>= 4 GiB) on host memory, a 32nd (>= 1 GiB) on a card."""
    raw = os.environ.get("TENSORFOLD_MEMORY_RESERVE_GIB", "").strip()
    if raw:
        try:
            gib = float(raw)
        except ValueError as exc:
            raise StartupError(f"TENSORFOLD_MEMORY_RESERVE_GIB must be a number of GiB, got {raw!r}") from exc
        floor = 2.0 if reading.unified else 0.5
        if gib < floor:
            raise StartupError(f"TENSORFOLD_MEMORY_RESERVE_GIB must be at least {floor} GiB here, got {gib}")
        return int(gib * GIB)
    if reading.unified:
        return max(reading.total_bytes // 10, 4 * GIB)
    return max(reading.total_bytes // 32, 1 * GIB)


@dataclass
class PoolPlan:
    num_blocks: int
    lanes: int  # sequences served at once (the `parallel` setting, resolved)
    window: int  # the effective context window
    reason: str  # how the pool was sized, for the policy line and the log


def plan_pool(
    *,
    budget_bytes: int,
    bytes_per_block: int,
    block_size: int,
    window: int,
    parallel: int | str,
    max_parallel_auto: int,
) -> PoolPlan:
    """Blocks from a byte budget; lanes from `parallel` or, for auto, from how many full windows fit."""
    if bytes_per_block <= 0:
        raise StartupError("the model declares no KV cache")
    blocks_per_window = -(-window // block_size)
    # More than every lane's full window (twice, for the prefix cache) is never used.
    lanes_cap = max_parallel_auto if parallel == "auto" else int(parallel)
    useful = 2 * lanes_cap * blocks_per_window
    num_blocks = min(budget_bytes // bytes_per_block, useful)
    if num_blocks < 1:
        raise StartupError(
            f"no memory left for the KV cache ({budget_bytes / GIB:.2f} GiB after the model and the reserve); "
            "free memory, lower TENSORFOLD_MEMORY_RESERVE_GIB or set kv_cache_gib"
        )
    window = min(window, num_blocks * block_size)
    if parallel == "auto":
        lanes = max(1, min(max_parallel_auto, (num_blocks * block_size) // window))
    else:
        lanes = int(parallel)
    return PoolPlan(
        num_blocks=num_blocks,
        lanes=lanes,
        window=window,
        reason=f"{num_blocks} blocks of {block_size} tokens ({num_blocks * bytes_per_block / GIB:.2f} GiB)",
    )


@dataclass
class StatePlan:
    """A hybrid model's state slots, sized before its KV pool (which takes what they leave)."""

    lanes: int  # concurrent sequences the slots are sized for
    slots_per_lane: int  # a lane's running and rolling slots, and a verify round's rows
    max_snapshots: int  # state snapshots the budget holds (the engine keeps no more than it has blocks)
    kv_budget_bytes: int  # what is left for the KV pool

    def num_slots(self, snapshots: int) -> int:
        return self.lanes * self.slots_per_lane + snapshots


SNAPSHOT_SHARE = 0.25  # of the budget, for state snapshots when prompt_cache_gib sets no other cap


def plan_states(
    *,
    budget_bytes: int,
    slot_bytes: int,
    slots_per_lane: int,
    kv_bytes_per_token: int,
    window: int,
    parallel: int | str,
    max_parallel_auto: int,
    snapshot_cap_bytes: int | None,
) -> StatePlan:
    """Slots for every lane (running, rolling, a verify round's rows) and for the snapshots; `parallel:
    auto` counts a lane as a full window of KV plus its slots."""
    snapshot_bytes = int(budget_bytes * SNAPSHOT_SHARE)
    if snapshot_cap_bytes is not None:
        snapshot_bytes = min(snapshot_bytes, snapshot_cap_bytes)
    lane_bytes = slots_per_lane * slot_bytes
    usable = budget_bytes - snapshot_bytes
    if parallel == "auto":
        lanes = max(1, min(max_parallel_auto, usable // (window * kv_bytes_per_token + lane_bytes)))
    else:
        lanes = int(parallel)
    kv_budget = usable - lanes * lane_bytes
    if kv_budget <= 0:
        raise StartupError(
            f"no memory left for the KV cache after {lanes} lanes' recurrent states "
            f"({lanes * lane_bytes / GIB:.2f} GiB): lower parallel or raise kv_cache_gib"
        )
    return StatePlan(lanes, slots_per_lane, snapshot_bytes // slot_bytes, kv_budget)


def _sharing(readings: list[MemoryReading]) -> list[int]:
    """How many of the ranks share each rank's memory: its host's ranks on host memory, else itself."""
    hosts = Counter(reading.host for reading in readings if reading.unified)
    return [hosts[reading.host] if reading.unified else 1 for reading in readings]


def _named(rank: int, readings: list[MemoryReading]) -> str:
    return f" (rank {rank})" if len(readings) > 1 else ""


def check_weights_fit(weight_bytes: int, readings: list[MemoryReading]) -> None:
    """Refuse to start when the weights alone would not fit, before loading a byte of them: each rank holds
    its share, and ranks on one host's memory hold theirs together."""
    for rank, (reading, sharing) in enumerate(zip(readings, _sharing(readings))):
        need = weight_bytes // len(readings) * sharing
        if need > reading.available_bytes:
            raise StartupError(
                f"too little memory for the model: its weights need {need / GIB:.2f} GiB, only "
                f"{reading.available_bytes / GIB:.2f} GiB is available on {reading.device}{_named(rank, readings)}"
            )


def check_checkpoint_fits(config: EngineConfig, readings: list[MemoryReading]) -> None:
    """Refuse to start when the checkpoint's weights would not fit the ranks' devices (before any is loaded)."""
    files = [*Path(config.model).glob("*.safetensors"), *Path(config.model).glob("*.gguf")]
    check_weights_fit(sum(p.stat().st_size for p in files), readings)


def kv_budget(config: EngineConfig, readings: list[MemoryReading]) -> int:
    """What one rank's KV pool may come out of, from the ranks' readings after the weights are loaded:
    `kv_cache_gib` split over the ranks, else the least any rank has available less its reserve (ranks on
    one host's memory share it)."""
    if config.kv_cache_gib is not None:
        return int(config.kv_cache_gib * GIB / config.tensor_parallel_size)
    budgets = []
    for rank, (reading, sharing) in enumerate(zip(readings, _sharing(readings))):
        budget = reading.available_bytes - reserve_bytes(reading)
        if budget <= 0:
            raise StartupError(
                f"too little memory for the KV cache{_named(rank, readings)}: {reading.available_bytes / GIB:.1f} "
                f"GiB available after loading the model, {reserve_bytes(reading) / GIB:.1f} GiB reserved "
                "(TENSORFOLD_MEMORY_RESERVE_GIB)"
            )
        budgets.append(budget // sharing)
    return min(budgets)

"""Sizing the KV pool from free memory less a reserve (the defaults: docs/config.md)."""

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from deployments.config import EngineConfig, StartupError
from deployments.model_rank.runner import RunnerInfo, resolve_device

GIB = 1 << 30


@dataclass
class MemoryReading:
    available_bytes: int  # what the pool may come out of, before the reserve
    total_bytes: int
    unified: bool  # host memory (CPU, or a GPU sharing RAM): the reserve rule differs


def read_memory(device: torch.device) -> MemoryReading:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return MemoryReading(available_bytes=free, total_bytes=total, unified=False)
    return read_host_memory()


def read_host_memory() -> MemoryReading:
    """RAM available and total: /proc/meminfo on Linux, the VM statistics elsewhere (a Mac)."""
    try:
        fields: dict[str, int] = {}
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                name, value = line.split(":", 1)
                fields[name] = int(value.split()[0]) * 1024
        return MemoryReading(available_bytes=fields["MemAvailable"], total_bytes=fields["MemTotal"], unified=True)
    except FileNotFoundError:
        return _darwin_memory()


def _darwin_memory() -> MemoryReading:
    """macOS: total from sysctl hw.memsize; available = free + inactive + purgeable pages (vm_stat)."""
    import re
    import subprocess

    total = int(subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True, check=True).stdout)
    stats = subprocess.run(["vm_stat"], capture_output=True, text=True, check=True).stdout
    named = re.search(r"page size of (\d+) bytes", stats)
    assert named is not None, f"vm_stat names no page size: {stats[:80]!r}"
    page = int(named.group(1))
    pages = {m.group(1): int(m.group(2)) for m in re.finditer(r"Pages (\w+):\s+(\d+)", stats)}
    available = sum(pages.get(name, 0) for name in ("free", "inactive", "purgeable", "speculative")) * page
    return MemoryReading(available_bytes=available, total_bytes=total, unified=True)


def read_mlx_memory() -> MemoryReading:
    """What an MLX pool may come out of: on Metal, the recommended GPU working set less what MLX holds now
    (the weights), within the host's available RAM; on the CPU, the host's RAM."""
    import mlx.core as mx

    host = read_host_memory()
    info = mx.device_info()
    working_set = info.get("max_recommended_working_set_size")
    if working_set is None:
        return host
    available = min(host.available_bytes, int(working_set) - mx.get_active_memory())
    return MemoryReading(
        available_bytes=max(available, 0), total_bytes=int(info.get("memory_size", host.total_bytes)), unified=True
    )


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


def check_weights_fit(weight_bytes: int, device: torch.device, tp_size: int = 1) -> None:
    """Refuse to start when the weights alone would not fit, before loading a byte of them."""
    reading = read_memory(device)
    need = weight_bytes // tp_size if not reading.unified else weight_bytes
    if need > reading.available_bytes:
        raise StartupError(
            f"too little memory for the model: its weights need {need / GIB:.2f} GiB, "
            f"only {reading.available_bytes / GIB:.2f} GiB is available on {device.type}"
        )


def check_checkpoint_fits(config: EngineConfig) -> None:
    """Refuse to start when the checkpoint's weights would not fit the device (before any is loaded)."""
    files = sum(p.stat().st_size for p in Path(config.model).glob("*.safetensors"))
    check_weights_fit(files, resolve_device(config.device), config.tensor_parallel_size)


def kv_budget(config: EngineConfig, runner: RunnerInfo) -> int:
    """What one rank's KV pool may come out of, read after the weights are loaded: `kv_cache_gib` split over
    the ranks, else the device's available memory less the reserve."""
    if config.kv_cache_gib is not None:
        return int(config.kv_cache_gib * GIB / config.tensor_parallel_size)
    reading = read_mlx_memory() if runner.backend == "mlx" else read_memory(torch.device(runner.device))
    budget = reading.available_bytes - reserve_bytes(reading)
    if budget <= 0:
        raise StartupError(
            f"too little memory for the KV cache: {reading.available_bytes / GIB:.1f} GiB available after "
            f"loading the model, {reserve_bytes(reading) / GIB:.1f} GiB reserved (TENSORFOLD_MEMORY_RESERVE_GIB)"
        )
    # Ranks on one host share its memory.
    shares = config.tensor_parallel_size if reading.unified else 1
    return budget // shares

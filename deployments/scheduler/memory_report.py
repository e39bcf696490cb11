"""A Scheduler replica's read-only memory snapshot for GET /memory: per replica, per rank.

Importable without torch (Ingress unpickles these types); torch is imported only where a CUDA device is
read. A figure this process cannot read (another rank's RSS, a device it does not hold) is left out
(None), never reported as zero.
"""

import ctypes
import os
import resource
import sys
from typing import Any

from deployments.messages.memory import DeviceMemory, MlxMemory, RankMemory, ReplicaMemory


def process_rss_bytes() -> int:
    """This process's resident set (Linux /proc; elsewhere the peak getrusage reports)."""
    try:
        with open(f"/proc/{os.getpid()}/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak) if os.uname().sysname == "Darwin" else int(peak) * 1024


def process_footprint_bytes() -> int:
    """This process's memory footprint: the phys_footprint macOS charges it (MLX's unified memory included),
    else its resident set."""
    if sys.platform == "darwin":
        try:
            return _darwin_footprint()
        except (OSError, AttributeError):
            pass
    return process_rss_bytes()


def _darwin_footprint() -> int:
    """proc_pid_rusage(RUSAGE_INFO_V2).ri_phys_footprint: after a 16-byte uuid, the 8th 64-bit field."""
    libc = ctypes.CDLL("libc.dylib", use_errno=True)
    buffer = (ctypes.c_uint64 * 64)()
    if libc.proc_pid_rusage(os.getpid(), 2, ctypes.byref(buffer)) != 0:
        raise OSError(ctypes.get_errno(), "proc_pid_rusage failed")
    return int(buffer[2 + 7])


def memory_figures_of(device: str) -> dict[str, int]:
    """The /health figures of this process's model memory: CUDA's or MLX's active, cache and peak bytes
    (the model's at tensor-parallel size 1), and always the process's footprint."""
    footprint = {"footprint": process_footprint_bytes()}
    if device.startswith("mlx"):
        import mlx.core as mx

        return {
            "active": mx.get_active_memory(),
            "cache": mx.get_cache_memory(),
            "peak": mx.get_peak_memory(),
        } | footprint
    if not device.startswith("cuda"):
        return footprint
    import torch

    if not torch.cuda.is_available():  # tensor-parallel ranks hold the GPUs, not this process
        return footprint
    cuda = {"active": int(torch.cuda.memory_allocated()), "cache": 0, "peak": int(torch.cuda.max_memory_allocated())}
    return cuda | footprint


def device_memory(device: str, reset_peak: bool = False) -> DeviceMemory | None:
    """This process's CUDA reading; `reset_peak` starts a new peak at the current allocation first."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():  # tensor-parallel ranks hold the GPUs, not this process
        return None
    if reset_peak:
        torch.cuda.reset_peak_memory_stats()
    free, total = torch.cuda.mem_get_info()
    return DeviceMemory(
        name=torch.cuda.get_device_name(),
        active_bytes=int(torch.cuda.memory_allocated()),
        reserved_bytes=int(torch.cuda.memory_reserved()),
        peak_bytes=int(torch.cuda.max_memory_allocated()),
        free_bytes=int(free),
        total_bytes=int(total),
    )


def mlx_memory(budget_bytes: int, reset_peak: bool = False) -> MlxMemory:
    import mlx.core as mx

    if reset_peak:
        mx.reset_peak_memory()
    return MlxMemory(
        active_bytes=mx.get_active_memory(),
        cache_bytes=mx.get_cache_memory(),
        peak_bytes=mx.get_peak_memory(),
        budget_bytes=budget_bytes,
        mlx_budget_bytes=mx.get_memory_limit(),
        footprint_bytes=process_footprint_bytes(),
    )


def replica_memory(replica: str, engine: Any, reset_peak: bool = False) -> ReplicaMemory:
    """The snapshot of one engine (read off its thread: only sizes and lengths, each read atomically)."""
    runner, blocks = engine.runner_info, engine.blocks
    per_block = runner.kv_bytes_per_token * blocks.block_size
    tp_size = engine.config.tensor_parallel_size
    # Above one rank the ranks hold the devices: this process reads none (no CUDA context of its own).
    device = device_memory(str(runner.device), reset_peak) if tp_size == 1 else None
    mlx = mlx_memory(engine.kv_budget_bytes, reset_peak) if runner.backend == "mlx" else None
    rss = process_rss_bytes()
    ranks = [
        RankMemory(
            rank=rank,
            weights_bytes=runner.weight_bytes,
            weights_format=runner.weights_format,
            kv_pool_bytes=per_block * blocks.num_blocks,
            kv_index_bytes=runner.index_bytes_per_token * blocks.block_size * blocks.num_blocks,
            state_pool_bytes=runner.state_bytes_per_slot * (0 if engine.states is None else engine.states.num_slots),
            process_rss_bytes=rss if tp_size == 1 else None,
            device=device,
            mlx=mlx,
        )
        for rank in range(tp_size)
    ]
    return ReplicaMemory(
        replica=replica,
        block_size=blocks.block_size,
        kv_blocks_total=blocks.num_blocks,
        kv_blocks_used=blocks.num_used,
        prompt_cache_blocks=len(blocks.by_hash),
        kv_bytes_per_block=per_block,
        process_rss_bytes=rss,
        ranks=ranks,
        state_slots_total=0 if engine.states is None else engine.states.num_slots,
        state_bytes_per_slot=runner.state_bytes_per_slot,
        state_slots_used=0 if engine.states is None else engine.states.num_used,
        state_snapshots=0 if engine.states is None else len(engine.states.snapshots),
    )

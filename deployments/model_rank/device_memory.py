"""What a rank measures of its own device's memory (the engine plans from these readings: docs/engine.md,
Memory). Read in the rank's process, the one that holds the device, so a Scheduler replica never touches
CUDA, even on a node without GPUs."""

import re
import socket
import subprocess

import torch

from deployments.messages.memory import MemoryReading


def read_memory(device: torch.device) -> MemoryReading:
    """A CUDA card's free and total memory, or the host's RAM."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return MemoryReading(free, total, unified=False, host=socket.gethostname(), device=str(device))
    return read_host_memory()


def read_host_memory() -> MemoryReading:
    """RAM available and total: /proc/meminfo on Linux, the VM statistics elsewhere (a Mac)."""
    try:
        fields: dict[str, int] = {}
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                name, value = line.split(":", 1)
                fields[name] = int(value.split()[0]) * 1024
        available, total = fields["MemAvailable"], fields["MemTotal"]
    except FileNotFoundError:
        available, total = _darwin_memory()
    return MemoryReading(available, total, unified=True, host=socket.gethostname(), device="cpu")


def _darwin_memory() -> tuple[int, int]:
    """macOS: (available, total): free + inactive + purgeable pages (vm_stat), sysctl hw.memsize."""
    total = int(subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True, check=True).stdout)
    stats = subprocess.run(["vm_stat"], capture_output=True, text=True, check=True).stdout
    named = re.search(r"page size of (\d+) bytes", stats)
    assert named is not None, f"vm_stat names no page size: {stats[:80]!r}"
    page = int(named.group(1))
    pages = {m.group(1): int(m.group(2)) for m in re.finditer(r"Pages (\w+):\s+(\d+)", stats)}
    available = sum(pages.get(name, 0) for name in ("free", "inactive", "purgeable", "speculative")) * page
    return available, total


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
    total = int(info.get("memory_size", host.total_bytes))
    return MemoryReading(max(available, 0), total, unified=True, host=host.host, device="mlx")

"""How many intra-op threads a rank's forward pass computes with, set once where the rank runs.

Ray sets OMP_NUM_THREADS to the floor of a replica's CPUs (1 for the graph's fractional replicas), which
would leave a multi-core CPU host computing on one core. The engine instead takes the node's cores less
what the graph's other replicas there need (Ingress and the Renderer), split between the node's ranks,
unless `engine_threads` says how many.
"""

import logging
import os

import torch

log = logging.getLogger("tensorfold.engine")


def node_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def engine_thread_count(
    explicit: int | None, reserved_cpus: float, ranks_on_node: int = 1, cores: int | None = None
) -> int:
    """`explicit`, or the node's cores less `reserved_cpus`, shared by `ranks_on_node` ranks (at least 1)."""
    if explicit is not None:
        return explicit
    free = (node_cores() if cores is None else cores) - reserved_cpus
    return max(1, round(free / max(ranks_on_node, 1)))


def use_engine_threads(explicit: int | None, reserved_cpus: float, ranks_on_node: int = 1) -> int:
    """Set torch's (and so the native CPU kernels') intra-op thread count for this process; returns it."""
    count = engine_thread_count(explicit, reserved_cpus, ranks_on_node)
    torch.set_num_threads(count)
    log.info("engine computes with %d intra-op threads", count)
    return count

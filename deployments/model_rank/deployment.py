"""The ModelRank Ray actor: one tensor-parallel shard of the model, its KV cache and its forward pass.

A rank joins its group when started, reports what memory its device has, and loads when the engine says
so (executor.py): the Scheduler replica plans from the ranks' readings and never touches their devices.
"""

import os
import socket
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.config import EngineConfig
from deployments.messages.memory import MemoryReading
from deployments.messages.slide import PocketCall
from deployments.messages.step import StepOutput, StepPlan
from deployments.model_rank.device_memory import read_memory
from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.runner import ModelRunner, RunnerInfo, resolve_device
from deployments.model_rank.threads import use_engine_threads
from kernels import dispatch


class ModelRank:
    """Holds one shard; joins its torch.distributed group before loading weights."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int) -> None:
        self.config = config
        self.parallel = ParallelContext(tp_rank=rank, tp_size=world_size)
        self.runner: ModelRunner | None = None

    def address(self) -> str:
        """A rendezvous address on this rank's node (asked of rank 0 only)."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return f"tcp://{host}:{port}"

    def join(self, init_method: str) -> None:
        """Join the group (NCCL on GPUs, gloo on CPU) and take this rank's share of the cores."""
        import torch
        import torch.distributed as dist

        use_nccl = self.config.device != "cpu" and torch.cuda.is_available()
        if use_nccl:
            torch.cuda.set_device(0)  # Ray exposes only this rank's GPU
        dist.init_process_group(
            backend="nccl" if use_nccl else "gloo",
            init_method=init_method,
            rank=self.parallel.tp_rank,
            world_size=self.parallel.tp_size,
        )
        # Ranks of one copy share their node (STRICT_PACK by default): each takes its share of the cores.
        use_engine_threads(self.config.engine_threads, self.config.reserved_cpus, self.config.tensor_parallel_size)
        dispatch.use_cuda_matmul(self.config.cuda_matmul)

    def memory(self) -> MemoryReading:
        """What this rank's device has available now (before loading, and after)."""
        return read_memory(resolve_device(self.config.device) if self.runner is None else self.runner.device)

    def load(self) -> None:
        self.runner = ModelRunner(
            self.config.model,
            self.config.dtype,
            self.config.device,
            self.parallel,
            mtp=self.config.wants_mtp,
            vision=self.config.vision,
            pocket_neurons=self.config.pocket_neurons,
            cuda_graphs=not self.config.enforce_eager,
        )

    def warm_up(self, lanes: int) -> None:
        assert self.runner is not None
        self.runner.warm_up(lanes)

    def info(self) -> RunnerInfo:
        assert self.runner is not None
        return self.runner.info()

    def allocate_kv(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> None:
        assert self.runner is not None
        self.runner.allocate_kv(num_blocks, block_size, num_state_slots)

    def execute(self, plan: StepPlan) -> StepOutput:
        assert self.runner is not None
        return self.runner.execute(plan)

    def pocket_call(self, call: PocketCall[Any]) -> object:
        assert self.runner is not None
        return self.runner.pocket_call(call)

    def read_block_rows(self, block_ids: list[int]) -> np.ndarray:
        assert self.runner is not None
        return self.runner.read_block_rows(block_ids)

    def write_block_rows(self, block_ids: list[int], rows: np.ndarray) -> None:
        assert self.runner is not None
        self.runner.write_block_rows(block_ids, rows)

    def read_state_slots(self, slots: list[int]) -> np.ndarray:
        assert self.runner is not None
        return self.runner.read_state_slots(slots)

    def write_state_slots(self, slots: list[int], rows: np.ndarray) -> None:
        assert self.runner is not None
        self.runner.write_state_slots(slots, rows)


def _rank_options(config: EngineConfig, index: int) -> dict:
    on_gpu = config.device == "cuda" or (config.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    options: dict = {"num_cpus": float(os.environ.get("TENSORFOLD_RANK_CPUS", "0.5"))}
    if on_gpu:
        options["num_gpus"] = 1
    group = get_current_placement_group()
    if group is not None:
        # Bundle 0 holds the Scheduler replica itself; rank i takes bundle i + 1.
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=index + 1
        )
    return options


def start_rank_actors(config: EngineConfig) -> list:
    """Start every rank of one model copy and join their group (nothing loaded yet); their handles, rank order."""
    world = config.tensor_parallel_size
    remote_cls = ray.remote(ModelRank)
    ranks = [remote_cls.options(**_rank_options(config, index)).remote(config, index, world) for index in range(world)]
    init_method = ray.get(ranks[0].address.remote())
    ray.get([rank.join.remote(init_method) for rank in ranks])
    return ranks

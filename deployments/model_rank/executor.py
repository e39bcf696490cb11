"""How a Scheduler replica drives its ranks: in-process at tensor-parallel size 1, Ray actors above.

At size 1 there is no Ray call per step. At size N the replica starts N ModelRank actors in its placement
group (one bundle each after the replica's own), joins them in one torch.distributed group, and sends each
step's plan to all of them; every rank draws the same tokens, and rank 0's are used.

An executor starts its ranks without loading: the engine first asks each rank what memory its device has
(`memory`), refuses a checkpoint that would not fit, then has them `load`; it sizes the pool from the
ranks' readings after loading, and `warm_up` compiles the kernels and captures the decode graphs. The
replica itself never reads a device (docs/engine.md, Memory).
"""

import functools
from typing import Protocol

import numpy as np

from deployments.config import EngineConfig
from deployments.messages.calls import Reply
from deployments.messages.memory import MemoryReading
from deployments.messages.slide import PocketCall
from deployments.messages.step import StepOutput, StepPlan
from deployments.model_rank.backend import resolve_backend
from deployments.model_rank.device_memory import read_memory, read_mlx_memory
from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.runner import ModelRunner, RunnerInfo, resolve_device
from deployments.model_rank.threads import use_engine_threads
from kernels import dispatch


class Executor(Protocol):
    def memory(self) -> list[MemoryReading]: ...  # each rank's reading of its device, rank order

    def load(self) -> None: ...  # every rank loads its shard of the weights

    def info(self) -> RunnerInfo: ...

    def allocate_kv(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> None: ...

    def warm_up(self, lanes: int) -> None: ...  # compile the kernels, capture the decode graphs (CUDA)

    def execute(self, plan: StepPlan) -> StepOutput: ...

    def kv_bytes_per_token(self) -> int: ...  # every rank's shard together

    def state_bytes_per_slot(self) -> int: ...  # every rank's recurrent states of one slot together

    def read_block_rows(self, block_ids: list[int]) -> np.ndarray: ...  # [n, block bytes] (the disk store's rows)

    def write_block_rows(self, block_ids: list[int], rows: np.ndarray) -> None: ...

    def read_state_slots(self, slots: list[int]) -> np.ndarray: ...  # [n, state bytes] (hybrid models' snapshots)

    def write_state_slots(self, slots: list[int], rows: np.ndarray) -> None: ...

    def pocket_call(self, call: PocketCall[Reply]) -> Reply: ...  # every rank; rank 0's answer (pocket_ops.py)

    def shutdown(self) -> None: ...


class InProcessExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.threads = use_engine_threads(config.engine_threads, config.reserved_cpus)
        dispatch.use_cuda_matmul(config.cuda_matmul)
        self.runner: ModelRunner  # set by `load`

    def memory(self) -> list[MemoryReading]:
        return [read_memory(resolve_device(self.config.device))]

    def load(self) -> None:
        config = self.config
        self.runner = ModelRunner(
            config.model,
            config.dtype,
            config.device,
            ParallelContext(),
            mtp=config.wants_mtp,
            vision=config.vision,
            pocket_neurons=config.pocket_neurons,
            cuda_graphs=not config.enforce_eager,
        )

    def warm_up(self, lanes: int) -> None:
        self.runner.warm_up(lanes)

    def info(self) -> RunnerInfo:
        return self.runner.info()

    def allocate_kv(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> None:
        self.runner.allocate_kv(num_blocks, block_size, num_state_slots)

    def execute(self, plan: StepPlan) -> StepOutput:
        return self.runner.execute(plan)

    def kv_bytes_per_token(self) -> int:
        return self.runner.info().kv_bytes_per_token

    def state_bytes_per_slot(self) -> int:
        return self.runner.info().state_bytes_per_slot

    def read_block_rows(self, block_ids: list[int]) -> np.ndarray:
        return self.runner.read_block_rows(block_ids)

    def write_block_rows(self, block_ids: list[int], rows: np.ndarray) -> None:
        self.runner.write_block_rows(block_ids, rows)

    def read_state_slots(self, slots: list[int]) -> np.ndarray:
        return self.runner.read_state_slots(slots)

    def write_state_slots(self, slots: list[int], rows: np.ndarray) -> None:
        self.runner.write_state_slots(slots, rows)

    def pocket_call(self, call: PocketCall[Reply]) -> Reply:
        return call.reply(self.runner.pocket_call(call))

    def shutdown(self) -> None:
        pass


class RayRanksExecutor:
    def __init__(self, config: EngineConfig) -> None:
        import ray

        from deployments.model_rank.deployment import start_rank_actors

        self._ray = ray
        self.ranks = start_rank_actors(config)

    def _all(self, method: str, *args: object) -> list:
        return self._ray.get([getattr(rank, method).remote(*args) for rank in self.ranks])

    def memory(self) -> list[MemoryReading]:
        return self._all("memory")

    def load(self) -> None:
        self._all("load")

    def warm_up(self, lanes: int) -> None:
        self._all("warm_up", lanes)

    def info(self) -> RunnerInfo:
        return self._all("info")[0]

    def allocate_kv(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> None:
        self._all("allocate_kv", num_blocks, block_size, num_state_slots)

    def execute(self, plan: StepPlan) -> StepOutput:
        return self._all("execute", plan)[0]

    def kv_bytes_per_token(self) -> int:
        """Every rank's KV shard together (what a stored block holds)."""
        return sum(self._rank_token_bytes())

    @functools.cache
    def _rank_token_bytes(self) -> list[int]:
        return [info.kv_bytes_per_token for info in self._all("info")]

    def read_block_rows(self, block_ids: list[int]) -> np.ndarray:
        """Each rank's rows of these blocks side by side: [n, rank 0's bytes + rank 1's + ...]."""
        return np.concatenate(self._all("read_block_rows", block_ids), axis=1)

    def write_block_rows(self, block_ids: list[int], rows: np.ndarray) -> None:
        widths = [share * rows.shape[1] // self.kv_bytes_per_token() for share in self._rank_token_bytes()]
        starts = np.cumsum([0, *widths])
        parts = [rows[:, starts[i] : starts[i + 1]] for i in range(len(self.ranks))]
        self._ray.get([rank.write_block_rows.remote(block_ids, part) for rank, part in zip(self.ranks, parts)])

    def state_bytes_per_slot(self) -> int:
        """Every rank's states of one slot together (what a stored snapshot holds)."""
        return sum(info.state_bytes_per_slot for info in self._all("info"))

    def read_state_slots(self, slots: list[int]) -> np.ndarray:
        """Each rank's states in these slots side by side, as block rows are."""
        return np.concatenate(self._all("read_state_slots", slots), axis=1)

    def write_state_slots(self, slots: list[int], rows: np.ndarray) -> None:
        widths = [info.state_bytes_per_slot for info in self._all("info")]
        starts = np.cumsum([0, *widths])
        parts = [rows[:, starts[i] : starts[i + 1]] for i in range(len(self.ranks))]
        self._ray.get([rank.write_state_slots.remote(slots, part) for rank, part in zip(self.ranks, parts)])

    def pocket_call(self, call: PocketCall[Reply]) -> Reply:
        return call.reply(self._all("pocket_call", call)[0])

    def shutdown(self) -> None:
        for rank in self.ranks:
            self._ray.kill(rank)
        self.ranks = []


class MlxExecutor(InProcessExecutor):
    """The MLX rank, in the replica's process (an MLX rank holds the whole model)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def memory(self) -> list[MemoryReading]:
        return [read_mlx_memory()]

    def load(self) -> None:
        from deployments.model_rank.mlx_rank.runner import MlxRunner

        config = self.config
        self.runner = MlxRunner(  # type: ignore[assignment]
            config.model, config.dtype, mtp=config.wants_mtp, vision=config.vision
        )

    def warm_up(self, lanes: int) -> None:
        pass  # MLX compiles nothing ahead and has no graphs to capture


def make_executor(config: EngineConfig) -> Executor:
    if resolve_backend(config) == "mlx":
        return MlxExecutor(config)
    if config.tensor_parallel_size == 1:
        return InProcessExecutor(config)
    return RayRanksExecutor(config)

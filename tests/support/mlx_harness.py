"""PagedHarness (tests/support/model_harness.py) over the MLX rank: the same sequence, block and state-slot
bookkeeping, each step run by an `MlxRunner`'s model on its own KV arrays and state pools."""

import mlx.core as mx
import torch

from deployments.model_rank.mlx_rank.arrays import to_torch
from deployments.model_rank.mlx_rank.batch import MlxBatch
from deployments.model_rank.mlx_rank.runner import MlxRunner
from deployments.model_rank.step_rows import StepRows
from tests.support.model_harness import PagedHarness


class MlxHarness(PagedHarness):
    def __init__(self, runner: MlxRunner, block_size: int = 16, num_blocks: int = 128, num_slots: int = 16) -> None:
        self.runner = runner
        self.block_size, self.num_blocks, self.next_block = block_size, num_blocks, 0
        self.seqs = {}
        self.logits_rows: list[int] = []  # the latest batch's
        runner.allocate_kv(num_blocks, block_size, num_slots)  # fresh, zeroed arrays and pools
        self.state_pools = [tuple(mixer.pools()) for mixer in runner.recurrents]

    def pools(self) -> list[tuple[mx.array, mx.array]]:
        """Each recurrent layer's (conv, state) pools as they are now."""
        return [tuple(mixer.pools()) for mixer in self.runner.recurrents]

    def mlx_batch(
        self,
        chunks: list[tuple[int, list[int]]],
        all_logits: bool = False,
        captures: list[list[tuple[int, int]]] | None = None,
    ) -> MlxBatch:
        """One step's MLX batch (the logits rows in `logits_rows`), as `batch` lays it out."""
        b = self.batch(chunks, all_logits, captures)
        self.logits_rows = b.logits_indices.tolist()
        rows = StepRows(
            input_ids=b.input_ids.tolist(),
            positions=b.positions.tolist(),
            slots=b.slot_mapping.tolist(),
            logits_rows=self.logits_rows,
            query_lens=b.query_lens,
            context_lens=b.context_lens,
            block_tables=b.block_tables,
            state_slots=b.state_slots,
            state_captures=b.state_captures,
        )
        return MlxBatch.from_rows(rows, self.block_size)

    def step(
        self,
        chunks: list[tuple[int, list[int]]],
        all_logits: bool = False,
        captures: list[list[tuple[int, int]]] | None = None,
    ) -> torch.Tensor:
        """Run one forward; returns float32 logits [R, V] for the rows `batch` selects."""
        batch = self.mlx_batch(chunks, all_logits, captures)
        model = self.runner.model
        logits = model.logits(model(batch)[mx.array(self.logits_rows, mx.int32)])
        mx.eval(logits, *self.runner._current_caches(), *self.runner._current_pools())
        return to_torch(logits)

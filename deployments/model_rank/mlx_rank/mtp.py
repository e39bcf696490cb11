"""The MTP layers in MLX (GLM's, Nemotron-H's), and their part in drafting (the drafter itself is
deployments/model_rank/mtp_drafts.py)."""

import time
from collections.abc import Callable

import mlx.core as mx

from deployments.model_rank.mlx_rank.batch import MlxBatch
from deployments.model_rank.mlx_rank.layers import Linear
from deployments.model_rank.step_rows import StepRows

Norm = Callable[[mx.array], mx.array]


class MtpLayer:
    """Embed the next token, fuse it with the trunk's state, then the layer's blocks (models/glm4_moe.py's
    Glm4MoeMTP: one decoder layer; models/nemotron_h_mtp.py: attention and MoE blocks).

    `end_norm` ends the blocks in what is fed back (Nemotron-H's `final_layernorm`); `head_norm` runs only
    before the head (GLM's `shared_head.norm`).
    """

    def __init__(
        self,
        embed: mx.array,
        enorm: Norm,
        hnorm: Norm,
        eh_proj: Linear,
        layers: list[Callable[[mx.array, MlxBatch], mx.array]],
        end_norm: Norm | None,
        head_norm: Norm | None,
        head: Linear,
    ) -> None:
        self.embed, self.enorm, self.hnorm, self.eh_proj = embed, enorm, hnorm, eh_proj
        self.layers, self.end_norm, self.head_norm, self.head = layers, end_norm, head_norm, head

    def residual(self, hidden: mx.array, next_ids: mx.array, batch: MlxBatch) -> mx.array:
        """What a chained draft feeds back as the hidden state [T, H]."""
        embeds = self.enorm(self.embed[next_ids])  # [T, H]
        fused = self.eh_proj(mx.concatenate([embeds, self.hnorm(hidden)], axis=-1))  # [T, 2H] -> [T, H]
        for layer in self.layers:
            fused = layer(fused, batch)
        return self.end_norm(fused) if self.end_norm is not None else fused

    def greedy(self, residual: mx.array) -> mx.array:
        normed = self.head_norm(residual) if self.head_norm is not None else residual
        return mx.argmax(self.head(normed).astype(mx.float32), axis=-1)  # [R]


class MlxMtpOps:
    """`mtp_drafts.MtpOps` over MLX arrays (lazy: a pass is evaluated where it is marked, to time it)."""

    def __init__(self, mtp: MtpLayer, block_size: int, caches: Callable[[], list[mx.array]]) -> None:
        """`caches`: the MTP layer's cache arrays as they are now (evaluated with each draft)."""
        self.mtp, self.block_size, self.caches = mtp, block_size, caches

    def batch(self, rows: StepRows) -> MlxBatch:
        return MlxBatch.from_rows(rows, self.block_size)

    def ids(self, values: list[int]) -> mx.array:
        return mx.array(values, mx.int32)

    def take(self, array: mx.array, rows: list[int]) -> mx.array:
        return array[mx.array(rows, mx.int32)]

    def residual(self, hidden: mx.array, next_ids: mx.array, batch: MlxBatch) -> mx.array:
        return self.mtp.residual(hidden, next_ids, batch)

    def greedy(self, residual: mx.array) -> mx.array:
        return self.mtp.greedy(residual)

    def read(self, arrays: list[mx.array]) -> list[list[int]]:
        mx.eval(*arrays)
        return [array.tolist() for array in arrays]

    def mark(self, after: mx.array | None) -> float:
        if after is not None:
            mx.eval(after, *self.caches())
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

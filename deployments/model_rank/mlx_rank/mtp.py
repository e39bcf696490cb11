"""The MTP layers in MLX (GLM's, Nemotron-H's), and their part in drafting (the drafter itself is
deployments/model_rank/mtp_drafts.py)."""

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
    """`mtp_drafts.MtpOps` over MLX arrays."""

    def __init__(self, mtp: MtpLayer, block_size: int, caches: Callable[[], list[mx.array]]) -> None:
        """`caches`: the MTP layer's cache arrays as they are now (evaluated with each draft)."""
        self.mtp, self.block_size, self.caches = mtp, block_size, caches

    def batch(self, rows: StepRows) -> MlxBatch:
        return MlxBatch.from_rows(rows, self.block_size)

    def take(self, array: mx.array, rows: list[int]) -> mx.array:
        return array[mx.array(rows, mx.int32)]

    def residual(self, hidden: mx.array, next_ids: list[int], batch: MlxBatch) -> mx.array:
        return self.mtp.residual(hidden, mx.array(next_ids, mx.int32), batch)

    def greedy(self, residual: mx.array) -> list[int]:
        return self.mtp.greedy(residual).tolist()

    def settle(self, array: mx.array) -> None:
        mx.eval(array, *self.caches())

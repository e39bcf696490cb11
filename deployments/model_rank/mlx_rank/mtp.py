"""GLM's MTP layer in MLX, and its part in drafting (the drafter itself is deployments/model_rank/mtp_drafts.py)."""

import mlx.core as mx

from deployments.model_rank.mlx_rank.attention import DecoderLayer
from deployments.model_rank.mlx_rank.batch import MlxBatch
from deployments.model_rank.mlx_rank.layers import Linear, RMSNorm
from deployments.model_rank.step_rows import StepRows


class MtpLayer:
    """models/glm4_moe.py's Glm4MoeMTP: embed the next token, fuse it with the trunk's state, one decoder layer."""

    def __init__(
        self,
        embed: mx.array,
        enorm: RMSNorm,
        hnorm: RMSNorm,
        eh_proj: Linear,
        layer: DecoderLayer,
        norm: RMSNorm,
        head: Linear,
    ) -> None:
        self.embed, self.enorm, self.hnorm, self.eh_proj = embed, enorm, hnorm, eh_proj
        self.layer, self.norm, self.head = layer, norm, head

    def residual(self, hidden: mx.array, next_ids: mx.array, batch: MlxBatch) -> mx.array:
        """The layer's output before `shared_head.norm` [T, H] (what a chained draft feeds back)."""
        embeds = self.enorm(self.embed[next_ids])  # [T, H]
        fused = self.eh_proj(mx.concatenate([embeds, self.hnorm(hidden)], axis=-1))  # [T, 2H] -> [T, H]
        return self.layer(fused, batch)

    def greedy(self, residual: mx.array) -> mx.array:
        return mx.argmax(self.head(self.norm(residual)).astype(mx.float32), axis=-1)  # [R]


class MlxMtpOps:
    """`mtp_drafts.MtpOps` over MLX arrays."""

    def __init__(self, mtp: MtpLayer, block_size: int) -> None:
        self.mtp, self.block_size = mtp, block_size

    def batch(self, rows: StepRows) -> MlxBatch:
        return MlxBatch.from_rows(rows, self.block_size)

    def take(self, array: mx.array, rows: list[int]) -> mx.array:
        return array[mx.array(rows, mx.int32)]

    def residual(self, hidden: mx.array, next_ids: list[int], batch: MlxBatch) -> mx.array:
        return self.mtp.residual(hidden, mx.array(next_ids, mx.int32), batch)

    def greedy(self, residual: mx.array) -> list[int]:
        return self.mtp.greedy(residual).tolist()

    def settle(self, array: mx.array) -> None:
        mx.eval(array, *self.mtp.layer.attn.cache.arrays)

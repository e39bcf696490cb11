"""MLA with DeepSeek sparse attention (GLM-5.3's and GLM-5.3-Flash's attention layers).

A `full` layer runs its indexer (layers/dsa_index.py): it writes each token's index row after the latent in
the same cache row, then selects, per sequence, which cached tokens each query attends to; a `shared` layer
reuses the selections of the last full layer before it in the same forward (`SelectionRelay`).
"""

import torch

from deployments.model_rank.forward_batch import ForwardBatch, ParallelContext
from deployments.model_rank.layers.dsa_index import PoolIndexer, SelectionRelay, TokenIndexer
from deployments.model_rank.layers.mla import MLAAttention, MLADims
from deployments.model_rank.layers.rotary import RotaryEmbedding
from kernels import cpu_gemm, dispatch
from kernels.attention_torch import gather_cache, sequence_spans


class IndexedMLAAttention(MLAAttention):
    """`indexer` None: a shared layer (reads `relay`); else a full one (fills it)."""

    def __init__(
        self,
        dims: MLADims,
        rotary: RotaryEmbedding | None,
        scale: float,
        parallel: ParallelContext,
        indexer: TokenIndexer | PoolIndexer | None,
        relay: SelectionRelay,
    ) -> None:
        super().__init__(dims, rotary, scale, parallel, index_dim=0 if indexer is None else indexer.row_width)
        self.indexer, self.relay = indexer, relay
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q_latent = self.q_latent(hidden)
        q_nope, q_rot, latents = self.project(hidden, q_latent, batch)
        if self.indexer is not None:
            latents = torch.cat([latents, self.indexer.rows(hidden, batch.positions)], dim=-1)
        dispatch.write_cache(self.bound_cache(), latents, batch.slot_mapping)
        if self.indexer is not None:
            self.relay.keeps = self._select(hidden, q_latent, batch)
        if self.relay.keeps is None:
            raise RuntimeError("a shared DSA layer ran before any full indexer layer")
        scale, cache = self.scale, self.bound_cache()
        out = dispatch.sparse_mla_attention(q_nope, q_rot, cache, batch, scale, self.absorbed(), self.relay.keeps)
        return self.project_out(out)

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj as (W_UK [Hl, nope, C], W_UV [Hl, v, C]) for the absorbed sparse attention; read once from
        the (possibly packed) weight."""
        if self._absorbed is None:
            weight, d = self.kv_b_proj.weight, self.dims
            if cpu_gemm.is_packed(weight):
                weight = cpu_gemm.rows(weight, torch.arange(weight.shape[0]))
            per_head = weight.detach().reshape(self.local_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
            uk, uv = per_head.split([d.qk_nope_head_dim, d.v_head_dim], dim=1)
            self._absorbed = (uk.contiguous(), uv.contiguous())
        return self._absorbed

    def _select(self, hidden: torch.Tensor, q_latent: torch.Tensor | None, batch: ForwardBatch) -> list[torch.Tensor]:
        """Each sequence's selection [Tq, context] from the index rows cached so far."""
        assert self.indexer is not None and q_latent is not None  # DSA configs always have a q latent
        queries = self.indexer.queries(hidden, q_latent, batch.positions)
        cache, keeps = self.bound_cache(), []
        for (start, end), length, table in zip(
            sequence_spans(batch.query_lens), batch.context_lens, batch.block_tables
        ):
            if end == start:
                keeps.append(torch.zeros(0, length, dtype=torch.bool, device=hidden.device))
                continue
            rows = gather_cache(cache[:, :, self.latent_width :], table, length)  # [L, index row]
            keeps.append(self.indexer.select(queries.part(start, end), rows, length - (end - start)))
        return keeps

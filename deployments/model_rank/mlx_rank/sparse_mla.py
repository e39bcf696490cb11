"""MLA with DeepSeek sparse attention in MLX (layers/dsa_attention.py's IndexedMLAAttention): a full layer
writes each token's index row after its latent in the same cache row and selects per sequence; a shared
layer reuses the relay's selections; attention is the absorbed form of kernels/sparse_mla.py.

Each query scores its sequence's whole context in float32, the tokens it did not select masked, as the
dense MLX attention masks the future: a token's place in the reductions is its position, whatever else
shares the step, so rows keep their bits solo, batched and chunked.
"""

import mlx.core as mx

from deployments.model_rank.mlx_rank.attention import MLAAttention
from deployments.model_rank.mlx_rank.batch import MlxBatch
from deployments.model_rank.mlx_rank.dsa_index import IndexQueries, PoolIndexer, SelectionRelay, TokenIndexer
from deployments.model_rank.mlx_rank.layers import Linear, RMSNorm, Rotary


def absorbed_attention(
    q_nope: mx.array,
    q_rot: mx.array,
    rows: mx.array,
    keep: mx.array,
    weights: tuple[mx.array, mx.array],
    scale: float,
) -> mx.array:
    """One sequence's queries over its cached rows, in float32: q_nope [Tq, H, nope], q_rot [Tq, H, R]
    (rotated), rows [L, C + R] (latent, then the rope key), keep [Tq, L], weights (W_UK [H, nope, C],
    W_UV^T [H, C, v]) float32 -> [Tq, H, v] in q's dtype."""
    w_uk, w_uv_t = weights
    latent, rope = w_uk.shape[2], q_rot.shape[2]
    c = rows[:, :latent].astype(mx.float32)  # [L, C]
    q_lat = q_nope.astype(mx.float32).transpose(1, 0, 2) @ w_uk  # [H, Tq, C]
    scores = q_lat @ c.T  # [H, Tq, L]
    if rope:
        k_rope = rows[:, latent : latent + rope].astype(mx.float32)  # [L, R]
        scores = scores + q_rot.astype(mx.float32).transpose(1, 0, 2) @ k_rope.T
    scores = mx.where(keep[None], scores * scale, -mx.inf)
    out = (mx.softmax(scores, axis=-1) @ c) @ w_uv_t  # [H, Tq, v]
    return out.transpose(1, 0, 2).astype(q_nope.dtype)


class IndexedMLAAttention(MLAAttention):
    """`indexer` None: a shared layer (reads `relay`); else a full one (fills it)."""

    def __init__(
        self,
        projections: tuple[Linear, RMSNorm, Linear, Linear, RMSNorm, Linear],
        kv_b: mx.array,
        rotary: Rotary | None,
        shape: tuple[int, int, int, int, int],
        scale: float,
        indexer: TokenIndexer | PoolIndexer | None,
        relay: SelectionRelay,
    ) -> None:
        """`projections`: q_a, q_a_norm, q_b, kv_a, kv_a_norm, o; `kv_b`: kv_b_proj's weight [H (nope + v), C];
        `shape`: heads, nope, rope, v, kv_lora_rank."""
        q_a, q_a_norm, q_b, kv_a, kv_a_norm, o = projections
        heads, nope, rope, v_dim, lora = shape
        per_head = kv_b.astype(mx.float32).reshape(heads, nope + v_dim, lora)
        super().__init__(None, q_a, q_a_norm, q_b, kv_a, kv_a_norm, Linear(kv_b, None), o, rotary, *shape, scale)
        self.absorbed = (per_head[:, :nope], per_head[:, nope:].transpose(0, 2, 1))  # W_UK, W_UV^T
        mx.eval(self.absorbed)  # MLX streams are per thread: not left for the engine's thread
        self.indexer, self.relay = indexer, relay
        self.latent_width = lora + rope

    def __call__(self, hidden: mx.array, batch: MlxBatch) -> mx.array:
        assert self.q_a is not None and self.q_a_norm is not None and self.q_b is not None
        tokens = hidden.shape[0]
        q_latent = self.q_a_norm(self.q_a(hidden))  # [T, q_lora_rank]
        q = self.q_b(q_latent).reshape(tokens, self.heads, self.nope + self.rope)
        q_nope, q_rot = q[..., : self.nope], q[..., self.nope :]
        latent = self.kv_a(hidden)  # [T, lora + rope]
        parts = [self.kv_a_norm(latent[:, : self.lora])]
        if self.rotary is not None:
            q_rot, k_rot = self.rotary(batch, q_rot, latent[:, None, self.lora :])  # [T, H, rope], [T, 1, rope]
            parts.append(k_rot[:, 0])
        if self.indexer is not None:
            parts.append(self.indexer.rows(hidden, batch))
        self.cache.write(0, mx.concatenate(parts, axis=-1), batch.slots)
        if self.indexer is not None:
            self.relay.keeps = self._select(self.indexer.queries(hidden, q_latent, batch), batch)
        if self.relay.keeps is None:
            raise RuntimeError("a shared DSA layer ran before any full indexer layer")
        outs = []
        for (start, end), slots, keep in zip(batch.spans, batch.context_slots, self.relay.keeps):
            if end > start and keep is not None:
                rows = self.cache.context(0, slots)  # [L, latent (+ index row)]
                outs.append(
                    absorbed_attention(q_nope[start:end], q_rot[start:end], rows, keep, self.absorbed, self.scale)
                )
        out = mx.concatenate(outs, axis=0)  # [T, H, v]
        return self.o(out.reshape(tokens, self.heads * self.v_dim))  # [T, H]

    def _select(self, queries: IndexQueries, batch: MlxBatch) -> list[mx.array | None]:
        """Each sequence's selection [Tq, L] from the index rows cached so far (None: no new rows)."""
        assert self.indexer is not None
        q, weights = queries
        keeps: list[mx.array | None] = []
        for (start, end), slots in zip(batch.spans, batch.context_slots):
            if end == start:
                keeps.append(None)
                continue
            rows = self.cache.context(0, slots)[:, self.latent_width :]  # [L, index row]
            part = (q[start:end], weights[start:end])
            keeps.append(self.indexer.select(part, rows, rows.shape[0] - (end - start)))
        return keeps

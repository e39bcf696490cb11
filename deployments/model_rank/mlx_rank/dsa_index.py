"""The DSA indexers in MLX (layers/dsa_index.py's TokenIndexer and PoolIndexer): the index rows a full layer
writes after its latent, and each query's selection over one sequence's cached rows.

Scores are float32 (MLX has no float64 on Metal; the MLX rank attends in float32 too), computed per sequence
on fixed-shape rows, so a score's bits do not depend on the chunk or batch around its query. The top-k keys
sort by one integer per candidate, (score, position) packed, so ties go to the earlier position whatever
the sort's stability, and a query keeps the same tokens solo, batched, chunked and cached.
"""

import mlx.core as mx

from deployments.model_rank.layers.dsa_index import INDEX_NORM_EPS
from deployments.model_rank.mlx_rank.batch import MlxBatch
from deployments.model_rank.mlx_rank.layers import Linear, Rotary

IndexQueries = tuple[mx.array, mx.array]  # q [T, h, D] in the model dtype, head weights [T, h] float32


class IndexKeyNorm:
    """The indexer's key LayerNorm, in float32 and rounded once."""

    def __init__(self, weight: mx.array, bias: mx.array) -> None:
        self.weight, self.bias = weight.astype(mx.float32), bias.astype(mx.float32)
        mx.eval(self.weight, self.bias)  # MLX streams are per thread: not left for the engine's thread

    def __call__(self, x: mx.array) -> mx.array:
        xf = x.astype(mx.float32)
        centred = xf - mx.mean(xf, axis=-1, keepdims=True)
        normed = centred * mx.rsqrt(mx.mean(centred * centred, axis=-1, keepdims=True) + INDEX_NORM_EPS)
        return (normed * self.weight + self.bias).astype(x.dtype)


class IndexProjections:
    """What both indexers share: wq_b (from the q latent), wk and its norm, and the per-head weights."""

    def __init__(self, wq_b: Linear, wk: Linear, k_norm: IndexKeyNorm, weights: Linear, heads: int) -> None:
        self.wq_b, self.wk, self.k_norm = wq_b, wk, k_norm
        self.weights = weights  # weights_proj with a float32 weight, as the reference keeps it
        self.heads = heads

    def keys(self, hidden: mx.array) -> mx.array:
        return self.k_norm(self.wk(hidden))  # [T, D]

    def queries(self, hidden: mx.array, q_latent: mx.array) -> IndexQueries:
        q = self.wq_b(q_latent).reshape(hidden.shape[0], self.heads, -1)  # [T, h, D]
        return q, self.weights(hidden.astype(mx.float32)) * self.heads**-0.5


class TokenIndexer:
    """glm_moe_dsa's indexer: one key row [D] per token, its first rotary dims rotated."""

    def __init__(self, proj: IndexProjections, rotary: Rotary | None, head_dim: int, topk: int) -> None:
        self.proj, self.rotary, self.topk = proj, rotary, topk
        self.row_width = head_dim

    def rows(self, hidden: mx.array, batch: MlxBatch) -> mx.array:
        """The tokens' index rows [T, D]."""
        return self._rotated(self.proj.keys(hidden)[:, None, :], batch)[:, 0]

    def _rotated(self, x: mx.array, batch: MlxBatch) -> mx.array:
        return x if self.rotary is None else self.rotary.rotate(batch, x)

    def queries(self, hidden: mx.array, q_latent: mx.array, batch: MlxBatch) -> IndexQueries:
        q, weights = self.proj.queries(hidden, q_latent)
        return self._rotated(q, batch), weights

    def select(self, queries: IndexQueries, rows: mx.array, first: int) -> mx.array:
        """One sequence's selection [Tq, L] (bool): queries at positions first.., rows [L, D] cached so far."""
        count, length = queries[0].shape[0], rows.shape[0]
        scores = index_scores(queries, rows)  # [Tq, L]
        future = mx.arange(length)[None, :] > (first + mx.arange(count))[:, None]
        return top_mask(mx.where(future, -mx.inf, scores), self.topk) & ~future


class PoolIndexer:
    """glm5_next's k-pool indexer: a key row and the pool gate's logits [D each] per token; complete pools of
    `pool` tokens are the candidates, plus (with `tail`) the tokens after a query's last complete pool."""

    def __init__(
        self, proj: IndexProjections, gate: Linear, ape: mx.array, head_dim: int, topk: int, tail: bool
    ) -> None:
        self.proj, self.gate = proj, gate
        self.ape = ape.astype(mx.float32)  # [pool, D]
        mx.eval(self.ape)
        self.pool, self.head_dim, self.pools_kept, self.tail = ape.shape[0], head_dim, topk // ape.shape[0], tail
        self.row_width = 2 * head_dim

    def rows(self, hidden: mx.array, batch: MlxBatch) -> mx.array:
        """The tokens' index rows [T, 2D]: the normalised key, then the pool gate's logits."""
        return mx.concatenate([self.proj.keys(hidden), self.gate(hidden)], axis=-1)

    def queries(self, hidden: mx.array, q_latent: mx.array, batch: MlxBatch) -> IndexQueries:
        return self.proj.queries(hidden, q_latent)

    def select(self, queries: IndexQueries, rows: mx.array, first: int) -> mx.array:
        """One sequence's selection [Tq, L] (bool): queries at positions first.., rows [L, 2D]."""
        count, length = queries[0].shape[0], rows.shape[0]
        pools = length // self.pool  # complete pools in the cache
        positions = first + mx.arange(count)  # [Tq]
        visible = (positions + 1) // self.pool  # pools ending at or before each query
        keep = mx.zeros((count, length), mx.bool_)
        if pools:
            scores = index_scores(queries, self.pool_keys(rows[: pools * self.pool]))  # [Tq, P]
            hidden = mx.arange(pools)[None, :] >= visible[:, None]
            chosen = top_mask(mx.where(hidden, -mx.inf, scores), self.pools_kept) & ~hidden
            chosen = mx.repeat(chosen, self.pool, axis=1)  # [Tq, P * pool]
            keep = mx.concatenate([chosen, keep[:, pools * self.pool :]], axis=1)
        if not self.tail:
            return keep
        token = mx.arange(length)[None, :]
        return keep | ((token >= (visible * self.pool)[:, None]) & (token <= positions[:, None]))

    def pool_keys(self, rows: mx.array) -> mx.array:
        """Each complete pool's key [P, D] (float32): its tokens' keys mixed per channel by softmax(gate + ape)."""
        grouped = rows.reshape(-1, self.pool, 2 * self.head_dim).astype(mx.float32)
        keys, logits = grouped[..., : self.head_dim], grouped[..., self.head_dim :] + self.ape
        mix = mx.softmax(logits, axis=1)
        return (mix * keys).sum(axis=1)


def index_scores(queries: IndexQueries, keys: mx.array) -> mx.array:
    """[Tq, N] = sum_h w_h relu(q_h . k / sqrt(D)) in float32 (keys [N, D])."""
    q, weights = queries
    q = q.astype(mx.float32)  # [Tq, h, D]
    dots = mx.maximum((q @ keys.astype(mx.float32).T) * q.shape[-1] ** -0.5, 0)  # [Tq, h, N]
    return (weights[:, :, None] * dots).sum(axis=1)


def top_mask(scores: mx.array, k: int) -> mx.array:
    """[Tq, N] bool: each row's `k` best candidates, ties to the earlier one (all where N <= k)."""
    count, candidates = scores.shape
    if candidates <= k:
        return mx.ones((count, candidates), mx.bool_)
    order = mx.argsort(descending_key(scores), axis=-1)[:, :k]
    return mx.put_along_axis(mx.zeros((count, candidates), mx.bool_), order, mx.array(True), axis=-1)


def descending_key(scores: mx.array) -> mx.array:
    """[Tq, N] int64, each unique, ascending as (score descending, then position): float32 bits made to
    sort as integers (-0 read as +0), scaled past N, plus the position."""
    candidates = scores.shape[-1]
    bits = mx.where(scores == 0, 0.0, scores).astype(mx.float32).view(mx.int32)
    ordered = mx.where(bits < 0, mx.bitwise_xor(bits, mx.array(0x7FFFFFFF, mx.int32)), bits)
    return -ordered.astype(mx.int64) * candidates + mx.arange(candidates, dtype=mx.int64)


class SelectionRelay:
    """Hands a full indexer layer's selections (one [Tq, L] per sequence, None for one without new rows) to
    the `shared` layers after it within one forward."""

    def __init__(self) -> None:
        self.keeps: list[mx.array | None] | None = None

"""DSA indexers (GLM-5.3, GLM-5.3-Flash): which earlier tokens each query's sparse MLA attention reads.

An indexer scores keys with its own small heads, `sum_h w_h relu(q_h . k * D^-0.5) * H^-0.5`, from a key
row it writes per token beside the layer's latent in the paged cache (so the prefix cache, chunks, the disk
store and preemption keep it with the latent). Two kinds (docs/engine.md, "Sparse attention"):
- per token (`glm_moe_dsa`): the key is LayerNorm(wk x), its first `qk_rope_head_dim` dims rotated; a query
  keeps its `index_topk` best earlier tokens (every token while it has no more than that many);
- per k-pool (`glm5_next`): keys LayerNorm(wk x) and gate logits (x W_gate) are written per token; each
  complete pool of `index_kpool` tokens is one candidate, its key the per-channel softmax(gate + ape) mix of
  its tokens'; a query keeps its `index_topk / index_kpool` best pools that end at or before it, plus the
  tokens after the last complete pool (the incomplete tail).

Exactness: scores are computed per sequence in float64 over fixed-shape rows, and ties go to the earlier
position (a stable sort), so a query's selection is the same solo, batched, chunked and cached.
"""

import torch
import torch.nn.functional as F
from torch import nn

from deployments.model_rank.layers.linear import ReplicatedLinear, invariant_linear
from deployments.model_rank.layers.parallel import replicated_param
from deployments.model_rank.layers.rotary import RotaryEmbedding

INDEX_NORM_EPS = 1e-6  # the indexers' key LayerNorm, as the reference models build it


class IndexKeyNorm(nn.Module):
    """The indexer's key LayerNorm (`k_norm`: weight and bias)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight, self.bias = replicated_param(size), replicated_param(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, INDEX_NORM_EPS)


class WideProjection(nn.Module):
    """`weights_proj`: held in float32 and applied to the input widened to float32 at least (as the reference
    keeps it), outside the packed bf16 projections."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = replicated_param(out_features, in_features)
        self.weight.data = self.weight.data.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        return invariant_linear(x.to(wide), self.weight.to(wide))


class TokenIndexer(nn.Module):
    """glm_moe_dsa's indexer: one key row [index_head_dim] per token."""

    def __init__(
        self, hidden_size: int, q_lora_rank: int, heads: int, head_dim: int, topk: int, rotary: RotaryEmbedding | None
    ) -> None:
        super().__init__()
        self.heads, self.head_dim, self.topk, self.rotary = heads, head_dim, topk, rotary
        self.wq_b = ReplicatedLinear(q_lora_rank, heads * head_dim)
        self.wk = ReplicatedLinear(hidden_size, head_dim)
        self.k_norm = IndexKeyNorm(head_dim)
        self.weights_proj = WideProjection(hidden_size, heads)

    @property
    def row_width(self) -> int:
        """What a token writes to the cache row after the latent."""
        return self.head_dim

    def rows(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The tokens' cache rows [T, head_dim]: normalised keys, their rope part rotated."""
        return self._rotated(self.k_norm(self.wk(hidden))[:, None, :], positions)[:, 0]

    def _rotated(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, h, head_dim] with its first rotary dims rotated (the rest pass through)."""
        if self.rotary is None:
            return x
        width = self.rotary.rotary_dim
        rot, rest = x[..., :width], x[..., width:]
        rot, _ = self.rotary(positions, rot, rot[:, :1])
        return torch.cat([rot, rest], dim=-1)

    def queries(self, hidden: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor) -> "IndexQueries":
        q = self._rotated(self.wq_b(q_latent).view(-1, self.heads, self.head_dim), positions)
        return IndexQueries(q, head_weights(self.weights_proj, hidden, self.heads))

    def select(self, queries: "IndexQueries", rows: torch.Tensor, first: int) -> torch.Tensor:
        """One sequence's selection [Tq, L]: queries at positions first.., rows [L, head_dim] cached so far."""
        scores = index_scores(queries, rows.double())  # [Tq, L]
        return top_keys(scores, first, self.topk)


class PoolIndexer(nn.Module):
    """glm5_next's k-pool indexer: a key row and a gate row [index_head_dim each] per token."""

    def __init__(
        self, hidden_size: int, q_lora_rank: int, heads: int, head_dim: int, topk: int, pool: int, tail: bool = True
    ) -> None:
        super().__init__()
        if pool < 1 or topk % pool:
            raise ValueError(f"index_topk ({topk}) is not a multiple of index_kpool ({pool})")
        self.heads, self.head_dim, self.pools_kept, self.pool = heads, head_dim, topk // pool, pool
        self.tail = tail  # index_kpool_always_select_tail: the incomplete pool's tokens are always read
        self.wq_b = ReplicatedLinear(q_lora_rank, heads * head_dim)
        self.wk = ReplicatedLinear(hidden_size, head_dim)
        self.k_norm = IndexKeyNorm(head_dim)
        self.weights_proj = WideProjection(hidden_size, heads)
        self.index_kpool_compress_ape = replicated_param(pool, head_dim)
        self.index_kpool_compress_gate = replicated_param(head_dim, hidden_size)

    @property
    def row_width(self) -> int:
        return 2 * self.head_dim

    def rows(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The tokens' cache rows [T, 2 * head_dim]: the normalised key, then the pool gate's logits."""
        logits = invariant_linear(hidden, self.index_kpool_compress_gate)
        return torch.cat([self.k_norm(self.wk(hidden)), logits], dim=-1)

    def queries(self, hidden: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor) -> "IndexQueries":
        q = self.wq_b(q_latent).view(-1, self.heads, self.head_dim)
        return IndexQueries(q, head_weights(self.weights_proj, hidden, self.heads))

    def select(self, queries: "IndexQueries", rows: torch.Tensor, first: int) -> torch.Tensor:
        """One sequence's selection [Tq, L] (queries at positions first.., rows [L, 2 * head_dim])."""
        length, count = rows.shape[0], queries.q.shape[0]
        pools = length // self.pool  # complete pools in the cache
        keys = self.pool_keys(rows[: pools * self.pool])  # [P, D]
        scores = index_scores(queries, keys)  # [Tq, P]
        positions = torch.arange(first, first + count, device=rows.device)
        visible = (positions + 1) // self.pool  # pools ending at or before each query
        pool_ids = torch.arange(pools, device=rows.device)
        scores = scores.masked_fill(pool_ids[None, :] >= visible[:, None], float("-inf"))
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : self.pools_kept]  # [Tq, k]
        chosen = torch.zeros(count, pools, dtype=torch.bool, device=rows.device)
        chosen.scatter_(1, order, True)
        chosen &= pool_ids[None, :] < visible[:, None]
        keep = chosen.repeat_interleave(self.pool, dim=1)  # [Tq, P * pool]
        keep = F.pad(keep, (0, length - keep.shape[1]))
        if not self.tail:
            return keep
        token = torch.arange(length, device=rows.device)
        tail = (token[None, :] >= (visible * self.pool)[:, None]) & (token[None, :] <= positions[:, None])
        return keep | tail

    def pool_keys(self, rows: torch.Tensor) -> torch.Tensor:
        """Each complete pool's key [P, D] (float64) from its tokens' rows [P * pool, 2 * D]."""
        keys, logits = rows.view(-1, self.pool, 2 * self.head_dim).split(self.head_dim, dim=-1)
        mix = torch.softmax(logits.double() + self.index_kpool_compress_ape.double(), dim=1)
        return (mix * keys.double()).sum(dim=1)


class IndexQueries:
    """A step's index queries for one layer: q [T, h, D] and the per-head weights [T, h] (float64)."""

    def __init__(self, q: torch.Tensor, weights: torch.Tensor) -> None:
        self.q, self.weights = q, weights

    def part(self, start: int, end: int) -> "IndexQueries":
        return IndexQueries(self.q[start:end], self.weights[start:end])


def head_weights(proj: WideProjection, hidden: torch.Tensor, heads: int) -> torch.Tensor:
    """Each index head's weight per token [T, h] (float64), scaled by h^-0.5."""
    return proj(hidden).double() * heads**-0.5


def index_scores(queries: IndexQueries, keys: torch.Tensor) -> torch.Tensor:
    """[Tq, L] = sum_h w_h relu(q_h . k / sqrt(D)) in float64 (keys [L, D])."""
    q = queries.q.double()  # [Tq, h, D]
    dots = torch.relu(torch.matmul(q, keys.double().t()) * q.shape[-1] ** -0.5)  # [Tq, h, L]
    return (queries.weights[:, :, None] * dots).sum(dim=1)


def top_keys(scores: torch.Tensor, first: int, topk: int) -> torch.Tensor:
    """The `topk` best keys at or before each query (queries at positions first..; ties to the earlier key)."""
    count, length = scores.shape
    positions = torch.arange(first, first + count, device=scores.device)
    future = torch.arange(length, device=scores.device)[None, :] > positions[:, None]
    order = torch.sort(scores.masked_fill(future, float("-inf")), dim=-1, descending=True, stable=True).indices
    keep = torch.zeros(count, length, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, order[:, :topk], True)
    return keep & ~future


class SelectionRelay:
    """Hands a full indexer layer's selections to the `shared` layers after it within one forward."""

    def __init__(self) -> None:
        self.keeps: list[torch.Tensor] | None = None

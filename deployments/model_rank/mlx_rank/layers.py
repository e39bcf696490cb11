"""MLX mirrors of the torch layers (deployments/model_rank/layers): same tensors, same order of operations.

Each class is built from its torch twin by `mirror.py`. Shapes follow the torch layers: T flat tokens.
"""

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from deployments.model_rank.layers.moe import RoutingConfig
from deployments.model_rank.mlx_rank.batch import MlxBatch

GPU_TILE_ROWS = 16  # Metal picks its matmul kernel by row count: GPU projections run on whole 16-row tiles


def _row_tile() -> int:
    # MLX's CPU GEMMs were measured row-invariant at every row count; Metal's gemv (one row) is not gemm.
    return GPU_TILE_ROWS if mx.default_device() == mx.gpu else 1


def silu(x: mx.array) -> mx.array:
    """Computed in float32 and rounded once, as torch's bf16/fp16 silu does."""
    xf = x.astype(mx.float32)
    return (xf / (1 + mx.exp(-xf))).astype(x.dtype)


def sigmoid(x: mx.array) -> mx.array:
    """Computed in float32 and rounded once, as torch's bf16/fp16 sigmoid does."""
    return (1 / (1 + mx.exp(-x.astype(mx.float32)))).astype(x.dtype)


def softplus(x: mx.array) -> mx.array:
    """torch's softplus (beta 1, threshold 20) in float32, rounded once to x's dtype."""
    xf = x.astype(mx.float32)
    return mx.where(xf > 20, xf, mx.log1p(mx.exp(xf))).astype(x.dtype)


class Linear:
    """`x @ weight.T (+ bias)`, rows independent of how many share the call."""

    def __init__(self, weight: mx.array, bias: mx.array | None) -> None:
        self.weight = weight  # [N, K]
        self.bias = bias
        self.tile = _row_tile()

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.shape[0]
        padded = -(-rows // self.tile) * self.tile
        if padded != rows:
            x = mx.pad(x, [(0, padded - rows), (0, 0)])
        out = (x @ self.weight.T)[:rows]  # [M, N]
        return out + self.bias if self.bias is not None else out


class RMSNorm:
    def __init__(self, weight: mx.array, eps: float) -> None:
        self.weight = weight
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        xf = x.astype(mx.float32)
        xf = xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight * xf.astype(x.dtype)


class Rotary:
    """RoPE on [T, heads, head_dim] at the batch's positions (rotate-half or interleaved pairs, partial)."""

    def __init__(
        self, inv_freq: mx.array, scaling: float, interleaved: bool, mrope_axes: mx.array | None = None
    ) -> None:
        self.inv_freq = inv_freq  # [rot / 2] float32
        self.scaling = scaling
        self.interleaved = interleaved
        self.mrope_axes = mrope_axes  # [rot / 2] int32: each pair's position axis (multimodal RoPE), or None

    def _cos_sin(self, batch: MlxBatch, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        cached = batch.rope.get(id(self))
        if cached is None or cached[0].dtype != dtype:
            if batch.mrope_positions is not None and self.mrope_axes is not None:  # rows over an image
                freqs = mx.take(batch.mrope_positions, self.mrope_axes, axis=0).T * self.inv_freq  # [T, rot/2]
            else:
                freqs = batch.positions[:, None] * self.inv_freq  # [T, rot/2]
            emb = mx.concatenate([freqs, freqs], axis=-1)  # [T, rot]
            cached = (
                (mx.cos(emb) * self.scaling).astype(dtype)[:, None, :],
                (mx.sin(emb) * self.scaling).astype(dtype)[:, None, :],
            )
            batch.rope[id(self)] = cached
        return cached

    def __call__(self, batch: MlxBatch, q: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
        cos, sin = self._cos_sin(batch, q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def rotate(self, batch: MlxBatch, x: mx.array) -> mx.array:
        """One tensor [T, heads, dim] rotated alone (a DSA indexer's queries or keys)."""
        cos, sin = self._cos_sin(batch, x.dtype)
        return self._rotate(x, cos, sin)

    def _rotate(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        rot = cos.shape[-1]
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        if self.interleaved:
            c, s = cos[..., : rot // 2], sin[..., : rot // 2]
            x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
            out = mx.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
        else:
            half = mx.concatenate([-x_rot[..., rot // 2 :], x_rot[..., : rot // 2]], axis=-1)
            out = x_rot * cos + half * sin
        return mx.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out


def swiglu(gate: mx.array, up: mx.array, limit: float | None) -> mx.array:
    """silu(gate) * up; `limit` (GLM's swiglu_limit): gate clamped to at most limit, up to [-limit, limit]."""
    if limit is not None:
        gate, up = mx.minimum(gate, limit), mx.clip(up, -limit, limit)
    return silu(gate) * up


class GatedMLP:
    def __init__(self, gate: Linear, up: Linear, down: Linear, limit: float | None = None) -> None:
        self.gate, self.up, self.down, self.limit = gate, up, down, limit

    def __call__(self, x: mx.array) -> mx.array:
        return self.down(swiglu(self.gate(x), self.up(x), self.limit))  # [T, H]


@dataclass
class Router:
    weight: mx.array  # [E, H]
    correction_bias: mx.array | None  # [E] float32 (sigmoid scoring)
    routing: RoutingConfig

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(weights [T, k], expert ids [T, k]), best first; ties take the lower id."""
        r = self.routing
        if r.scoring == "sigmoid":
            logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T  # [T, E]
            return _grouped_sigmoid(logits, self.correction_bias, r)
        logits = x @ self.weight.T  # [T, E] in the model dtype
        probs = mx.softmax(logits.astype(mx.float32), axis=-1)
        ids = mx.argsort(-probs, axis=-1)[:, : r.top_k]
        weights = mx.take_along_axis(probs, ids, axis=-1)
        if r.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return weights.astype(logits.dtype), ids


def _grouped_sigmoid(logits: mx.array, bias: mx.array | None, r: RoutingConfig) -> tuple[mx.array, mx.array]:
    """GLM routing (kernels/moe_routing.py's rule): pick by score + bias within the best groups."""
    tokens, experts = logits.shape
    scores = 1 / (1 + mx.exp(-logits))  # [T, E]
    choice = scores + bias if bias is not None else scores
    if r.n_group > 1:
        grouped = choice.reshape(tokens, r.n_group, experts // r.n_group)  # [T, G, E/G]
        best_two = -mx.sort(-grouped, axis=-1)[..., :2]
        picked = mx.argsort(-best_two.sum(axis=-1), axis=-1)[:, : r.topk_group]  # [T, topk_group]
        keep = (mx.arange(r.n_group)[None, None, :] == picked[:, :, None]).any(axis=1)  # [T, G]
        choice = mx.where(keep[:, :, None], grouped, -mx.inf).reshape(tokens, experts)
    ids = mx.argsort(-choice, axis=-1)[:, : r.top_k]  # [T, k]
    weights = mx.take_along_axis(scores, ids, axis=-1)
    if r.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights * r.routed_scaling_factor, ids


class SparseMoE:
    """Router + stacked experts (gate/up [E, I, H], down [E, H, I]) + optional shared experts (a GatedMLP, or
    Qwen3-Next's sigmoid-gated one); `limit`: the experts' SwiGLU clamp (GLM's swiglu_limit)."""

    def __init__(
        self,
        router: Router,
        gate: mx.array,
        up: mx.array,
        down: mx.array,
        shared: Callable[[mx.array], mx.array] | None,
        limit: float | None = None,
    ) -> None:
        self.router, self.limit = router, limit
        self.gate_t, self.up_t, self.down_t = gate.swapaxes(-1, -2), up.swapaxes(-1, -2), down.swapaxes(-1, -2)
        # Evaluated here: MLX streams are per thread, and the engine steps on a thread of its own.
        mx.eval(self.gate_t, self.up_t, self.down_t)
        self.shared = shared

    def __call__(self, x: mx.array) -> mx.array:
        weights, ids = self.router(x)  # [T, k]
        gathered = x.dtype == mx.float32 or mx.default_device() == mx.gpu  # MLX's CPU gather_mm: float32 only
        out = self._gathered(x, ids) if gathered else self._per_expert(x, ids)  # [T, k, H]
        slots = (out * weights[:, :, None]).astype(x.dtype)
        total = slots[:, 0]
        for j in range(1, slots.shape[1]):
            total = total + slots[:, j]  # each token's slots summed in its own order
        if self.shared is not None:
            total = total + self.shared(x)
        return total

    def _gathered(self, x: mx.array, ids: mx.array) -> mx.array:
        rows = x[:, None, None, :]  # [T, 1, 1, H]: one matvec per (token, slot), whatever shares the call
        gate = mx.gather_mm(rows, self.gate_t, rhs_indices=ids)  # [T, k, 1, I]
        up = mx.gather_mm(rows, self.up_t, rhs_indices=ids)
        return mx.gather_mm(swiglu(gate, up, self.limit), self.down_t, rhs_indices=ids)[:, :, 0, :]  # [T, k, H]

    def _per_expert(self, x: mx.array, ids: mx.array) -> mx.array:
        """Each routed expert over the rows sent to it (reads the routing back to the host)."""
        tokens, top_k = ids.shape
        flat = np.array(ids).reshape(-1)  # [T * k]: token t's slot j at t * k + j
        out = mx.zeros((tokens * top_k, x.shape[1]), x.dtype)
        for expert in np.unique(flat).tolist():
            where = np.nonzero(flat == expert)[0]
            rows = x[mx.array(where // top_k, mx.int32)]  # [n, H]
            hidden = swiglu(rows @ self.gate_t[expert], rows @ self.up_t[expert], self.limit)
            out[mx.array(where, mx.int32)] = hidden @ self.down_t[expert]  # [n, H]
        return out.reshape(tokens, top_k, x.shape[1])

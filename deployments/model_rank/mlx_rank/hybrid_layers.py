"""MLX twins of the hybrid families' layers besides the recurrent ones, with the same tensors and order of
operations as deployments/model_rank/layers.

The float32-scaled RMSNorms (Nemotron-H's, and Qwen3-Next / Qwen3.5's zero-centred (1 + weight) one), gated
full attention, the sigmoid-gated shared expert, Nemotron-H's relu^2 MLP and latent MoE, and its blocks.
"""

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from deployments.model_rank.mlx_rank.attention import SelfAttention
from deployments.model_rank.mlx_rank.batch import MlxBatch
from deployments.model_rank.mlx_rank.layers import GatedMLP, Linear, Router, sigmoid

TOKEN_MIXERS = ("mamba", "attention")  # Nemotron-H block kinds whose mixer reads the step's batch


class ScaledRMSNorm:
    """RMSNorm whose float32 scale multiplies the float32 normalised row, rounded once at the end
    (layers/norm.py's WideScaleRMSNorm; `scale` is 1 + weight for the zero-centred norm)."""

    def __init__(self, scale: mx.array, eps: float) -> None:
        self.scale, self.eps = scale, eps  # [size] float32
        mx.eval(self.scale)

    def __call__(self, x: mx.array) -> mx.array:
        xf = x.astype(mx.float32)
        return (xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + self.eps) * self.scale).astype(x.dtype)


class GatedSelfAttention(SelfAttention):
    """Qwen3-Next / Qwen3.5 full attention: q_proj gives each head its query then an output gate of the same
    width; the attention output is scaled by sigmoid(gate) before o_proj."""

    def __call__(self, hidden: mx.array, batch: MlxBatch) -> mx.array:
        tokens, width = hidden.shape[0], self.heads * self.head_dim
        query_gate = self.q(hidden).reshape(tokens, self.heads, 2 * self.head_dim)  # [T, Hq, 2D]
        k = self.k(hidden).reshape(tokens, self.kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v(hidden).reshape(tokens, self.kv_heads, self.head_dim)  # [T, Hkv, D]
        out = self.attend(query_gate[..., : self.head_dim], k, v, batch)  # [T, Hq, D]
        gate = sigmoid(query_gate[..., self.head_dim :].reshape(tokens, width))
        return self.o(out.reshape(tokens, width) * gate)  # [T, H]


class GatedSharedExpert:
    """sigmoid(shared_expert_gate(x)) * shared_expert(x) (Qwen3-Next / Qwen3.5-MoE)."""

    def __init__(self, expert: GatedMLP, gate: Linear) -> None:
        self.expert, self.gate = expert, gate

    def __call__(self, x: mx.array) -> mx.array:
        return sigmoid(self.gate(x)) * self.expert(x)  # [T, 1] * [T, H]


def relu_squared(x: mx.array) -> mx.array:
    return mx.square(mx.maximum(x, 0))


class ReluSquaredMLP:
    """down(relu(up(x))^2), no gate (Nemotron-H's MLP blocks and shared experts)."""

    def __init__(self, up: Linear, down: Linear) -> None:
        self.up, self.down = up, down

    def __call__(self, x: mx.array) -> mx.array:
        return self.down(relu_squared(self.up(x)))  # [T, H]


class LatentMoE:
    """Nemotron-H's MoE: routed relu^2 experts (up [E, I, D], down [E, D, I]; D the latent size between the
    two latent projections, else the hidden size) plus the relu^2 shared expert; the router and the shared
    expert read the block's input. A token's weighted slots are summed in slot order, in float32."""

    def __init__(
        self,
        router: Router,
        up: mx.array,
        down: mx.array,
        shared: ReluSquaredMLP,
        fc1: Linear | None,
        fc2: Linear | None,
    ) -> None:
        self.router, self.shared, self.fc1, self.fc2 = router, shared, fc1, fc2
        self.up_t, self.down_t = up.swapaxes(-1, -2), down.swapaxes(-1, -2)
        mx.eval(self.up_t, self.down_t)  # MLX streams are per thread: not left for the engine's thread

    def __call__(self, x: mx.array) -> mx.array:
        weights, ids = self.router(x)  # [T, k] float32, [T, k]
        inner = self.fc1(x) if self.fc1 is not None else x  # [T, D]
        gathered = inner.dtype == mx.float32 or mx.default_device() == mx.gpu  # MLX's CPU gather_mm: float32 only
        out = self._gathered(inner, ids) if gathered else self._per_expert(inner, ids)  # [T, k, D]
        slots = out.astype(mx.float32) * weights[:, :, None]
        total = slots[:, 0]
        for j in range(1, slots.shape[1]):
            total = total + slots[:, j]  # each token's slots summed in its own order
        routed = total.astype(x.dtype)
        if self.fc2 is not None:
            routed = self.fc2(routed)  # [T, H]
        return routed + self.shared(x)

    def _gathered(self, x: mx.array, ids: mx.array) -> mx.array:
        rows = x[:, None, None, :]  # [T, 1, 1, D]: one matvec per (token, slot), whatever shares the call
        hidden = relu_squared(mx.gather_mm(rows, self.up_t, rhs_indices=ids))  # [T, k, 1, I]
        return mx.gather_mm(hidden, self.down_t, rhs_indices=ids)[:, :, 0, :]  # [T, k, D]

    def _per_expert(self, x: mx.array, ids: mx.array) -> mx.array:
        """Each routed expert over the rows sent to it (reads the routing back to the host)."""
        tokens, top_k = ids.shape
        flat = np.array(ids).reshape(-1)  # [T * k]: token t's slot j at t * k + j
        out = mx.zeros((tokens * top_k, x.shape[1]), x.dtype)
        for expert in np.unique(flat).tolist():
            where = np.nonzero(flat == expert)[0]
            rows = x[mx.array(where // top_k, mx.int32)]  # [n, D]
            out[mx.array(where, mx.int32)] = relu_squared(rows @ self.up_t[expert]) @ self.down_t[expert]
        return out.reshape(tokens, top_k, x.shape[1])


class NemotronBlock:
    """h + mixer(norm(h)); `kind` says whether the mixer reads the step's batch (Mamba2, attention)."""

    def __init__(self, kind: str, norm: ScaledRMSNorm, mixer: Callable) -> None:
        self.kind, self.norm, self.mixer = kind, norm, mixer

    def __call__(self, hidden: mx.array, batch: MlxBatch) -> mx.array:
        normed = self.norm(hidden)  # [T, H]
        mixed = self.mixer(normed, batch) if self.kind in TOKEN_MIXERS else self.mixer(normed)
        return hidden + mixed  # [T, H]

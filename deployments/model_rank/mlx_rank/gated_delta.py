"""The Gated DeltaNet mixer of Qwen3-Next and Qwen3.5 in MLX: layers/gated_delta.py's computation, op for op
(its docstring has the recurrence), on the state slots of mlx_rank/recurrent.py."""

import mlx.core as mx

from deployments.model_rank.layers.gated_delta import L2_EPS, GatedDeltaNetShape
from deployments.model_rank.mlx_rank.batch import MlxBatch
from deployments.model_rank.mlx_rank.layers import Linear, RMSNorm, sigmoid, silu, softplus
from deployments.model_rank.mlx_rank.recurrent import (
    RecurrentMixer,
    SequenceRows,
    causal_conv,
    history_after,
    sequence_rows,
)

Projected = tuple[mx.array, mx.array, mx.array, mx.array]  # qkv [T, conv_dim], z [T, Hv, Dv], b, a [T, Hv]


class GroupedProjections:
    """Qwen3-Next's `in_proj_qkvz` and `in_proj_ba`, rows laid out key head by key head."""

    def __init__(self, qkvz: Linear, ba: Linear, shape: GatedDeltaNetShape) -> None:
        self.qkvz, self.ba, self.shape = qkvz, ba, shape

    def __call__(self, hidden: mx.array) -> Projected:
        s, tokens = self.shape, hidden.shape[0]
        group_v = s.group * s.head_v_dim
        qkvz = self.qkvz(hidden).reshape(tokens, s.num_k_heads, -1)
        q, k, v, z = mx.split(qkvz, [s.head_k_dim, 2 * s.head_k_dim, 2 * s.head_k_dim + group_v], axis=-1)
        b, a = mx.split(self.ba(hidden).reshape(tokens, s.num_k_heads, -1), [s.group], axis=-1)
        qkv = mx.concatenate([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], axis=-1)
        z = z.reshape(tokens, s.num_v_heads, s.head_v_dim)
        return qkv, z, b.reshape(tokens, s.num_v_heads), a.reshape(tokens, s.num_v_heads)


class SplitProjections:
    """Qwen3.5's `in_proj_qkv` (all q, all k, all v), `in_proj_z`, `in_proj_b` and `in_proj_a`."""

    def __init__(self, qkv: Linear, z: Linear, b: Linear, a: Linear, shape: GatedDeltaNetShape) -> None:
        self.qkv, self.z, self.b, self.a, self.shape = qkv, z, b, a, shape

    def __call__(self, hidden: mx.array) -> Projected:
        z = self.z(hidden).reshape(hidden.shape[0], self.shape.num_v_heads, self.shape.head_v_dim)
        return self.qkv(hidden), z, self.b(hidden), self.a(hidden)


def l2_normalise(x: mx.array) -> mx.array:
    """x / |x| over the last dim (float32)."""
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + L2_EPS)


class GatedDeltaNet(RecurrentMixer):
    """Conv history [K - 1, conv_dim] and state [num_v_heads, head_k_dim, head_v_dim] per sequence slot."""

    def __init__(
        self,
        shape: GatedDeltaNetShape,
        project: GroupedProjections | SplitProjections,
        conv_weight: mx.array,
        a_log: mx.array,
        dt_bias: mx.array,
        norm: RMSNorm,
        out_proj: Linear,
    ) -> None:
        self.shape, self.project = shape, project
        self.conv_weight = conv_weight  # [conv_dim, K]
        self.neg_a = -mx.exp(a_log.astype(mx.float32))  # [Hv]
        self.dt_bias = dt_bias.astype(mx.float32)  # [Hv]
        self.norm, self.out_proj = norm, out_proj
        mx.eval(self.neg_a, self.dt_bias)  # MLX streams are per thread: not left for the engine's thread

    def __call__(self, hidden: mx.array, batch: MlxBatch) -> mx.array:
        tokens, s = hidden.shape[0], self.shape
        qkv, z, b, a = self.project(hidden)
        beta = sigmoid(b).astype(mx.float32)  # [T, Hv]
        parts = [
            self._sequence(seq, qkv[seq.start : seq.end], a[seq.start : seq.end], beta[seq.start : seq.end])
            for seq in sequence_rows(batch)
            if seq.end > seq.start
        ]
        core = mx.concatenate(parts).astype(hidden.dtype)  # [T, Hv, Dv]
        gated = (self.norm(core) * silu(z.astype(mx.float32))).astype(hidden.dtype)  # norm before gate
        return self.out_proj(gated.reshape(tokens, s.value_dim))  # [T, H]

    def _sequence(self, seq: SequenceRows, qkv: mx.array, a: mx.array, beta: mx.array) -> mx.array:
        """One sequence's n new tokens after its slot's states (then stored back): [n, Hv, Dv] float32."""
        history = self.conv_pool[seq.slot]
        q, k, v = self._heads(silu(causal_conv(qkv, history, self.conv_weight, None).astype(qkv.dtype)))
        state = self.state_pool[seq.slot]  # [Hv, Dk, Dv]
        out = []
        for t in range(qkv.shape[0]):
            decay = mx.exp(self.neg_a * softplus(a[t].astype(mx.float32) + self.dt_bias))  # [Hv]
            state = state * decay[:, None, None]
            remembered = (state * k[t, :, :, None]).sum(axis=-2)  # [Hv, Dv]
            delta = (v[t] - remembered) * beta[t, :, None]
            state = state + k[t, :, :, None] * delta[:, None, :]
            out.append((state * q[t, :, :, None]).sum(axis=-2))
            if t in seq.captures:
                self.capture(seq, t, history_after(history, qkv, t), state)
        self.store(seq.slot, history_after(history, qkv, qkv.shape[0] - 1), state)
        return mx.stack(out)

    def _heads(self, mixed: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The conv output [n, conv_dim] as float32 q, k [n, Hv, Dk] (key heads repeated over their value
        heads, l2-normalised, q scaled) and v [n, Hv, Dv]."""
        s, n = self.shape, mixed.shape[0]
        q, k, v = mx.split(mixed, [s.key_dim, 2 * s.key_dim], axis=-1)
        q = l2_normalise(q.reshape(n, s.num_k_heads, s.head_k_dim).astype(mx.float32)) * s.head_k_dim**-0.5
        k = l2_normalise(k.reshape(n, s.num_k_heads, s.head_k_dim).astype(mx.float32))
        if s.group > 1:
            q, k = mx.repeat(q, s.group, axis=1), mx.repeat(k, s.group, axis=1)
        return q, k, v.reshape(n, s.num_v_heads, s.head_v_dim).astype(mx.float32)

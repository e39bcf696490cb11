"""Kimi delta attention in MLX (GLM-5.3-Flash's `linear_attention` layers): layers/kda.py's computation, op
for op (its docstring has the recurrence), on the state slots of mlx_rank/recurrent.py. The scan is
mlx_rank/gated_delta.py's with one decay per key channel instead of one per head."""

import mlx.core as mx

from deployments.model_rank.layers.kda import L2_EPS, KdaShape
from deployments.model_rank.mlx_rank.batch import MlxBatch
from deployments.model_rank.mlx_rank.layers import Linear, sigmoid, silu, softplus
from deployments.model_rank.mlx_rank.recurrent import (
    RecurrentMixer,
    SequenceRows,
    causal_conv,
    history_after,
    sequence_rows,
)


class SigmoidGatedRMSNorm:
    """RMSNorm(x) * weight * sigmoid(gate), all in float32 and rounded once (KDA's output norm)."""

    def __init__(self, weight: mx.array, eps: float) -> None:
        self.weight, self.eps = weight.astype(mx.float32), eps
        mx.eval(self.weight)  # MLX streams are per thread: not left for the engine's thread

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        xf = x.astype(mx.float32)
        normed = xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + self.eps) * self.weight
        return (normed * sigmoid(gate.astype(mx.float32))).astype(x.dtype)


def l2_divide(x: mx.array) -> mx.array:
    """x / sqrt(|x|^2 + eps) over the last dim (float32): divided, as the reference does."""
    return x / mx.sqrt((x * x).sum(axis=-1, keepdims=True) + L2_EPS)


class KimiDeltaAttention(RecurrentMixer):
    """Conv history [K - 1, 3 * width] and state [heads, head_dim, head_dim] per sequence slot."""

    def __init__(
        self,
        shape: KdaShape,
        qkv: tuple[Linear, Linear, Linear],
        conv_weight: mx.array,
        decay: tuple[Linear, Linear, mx.array, mx.array],
        b: Linear,
        gate: tuple[Linear, Linear],
        out: tuple[SigmoidGatedRMSNorm, Linear],
    ) -> None:
        """`conv_weight` [3 * width, K] (q, k, v taps); `decay`: f_a, f_b, A_log [h], dt_bias [width]; `gate`:
        g_a, g_b; `out`: the output norm and o_proj."""
        self.shape, self.qkv, self.conv_weight, self.b = shape, qkv, conv_weight, b
        self.f_a, self.f_b, a_log, dt_bias = decay
        self.rate = mx.exp(a_log.astype(mx.float32))[None, :, None]  # [1, h, 1]
        self.dt_bias = dt_bias.astype(mx.float32)  # [width]
        self.g_a, self.g_b = gate
        self.o_norm, self.o_proj = out
        self.heads = a_log.shape[0]
        mx.eval(self.rate, self.dt_bias)  # MLX streams are per thread: not left for the engine's thread

    def __call__(self, hidden: mx.array, batch: MlxBatch) -> mx.array:
        tokens, d = hidden.shape[0], self.shape.head_dim
        qkv = mx.concatenate([proj(hidden) for proj in self.qkv], axis=-1)  # [T, 3 * width]
        beta = sigmoid(self.b(hidden)).astype(mx.float32)  # [T, h]
        g = self._log_decay(hidden)  # [T, h, d]
        parts = [
            self._sequence(seq, qkv[seq.start : seq.end], g[seq.start : seq.end], beta[seq.start : seq.end])
            for seq in sequence_rows(batch)
            if seq.end > seq.start
        ]
        core = mx.concatenate(parts).astype(hidden.dtype)  # [T, h, d]
        gate = self.g_b(self.g_a(hidden)).reshape(tokens, self.heads, d)
        out = self.o_norm(core, gate)  # [T, h, d]
        return self.o_proj(out.reshape(tokens, self.heads * d))  # [T, H]

    def _log_decay(self, hidden: mx.array) -> mx.array:
        """g [T, h, d] float32: each key channel's log-decay for this token."""
        g = self.f_b(self.f_a(hidden)).astype(mx.float32) + self.dt_bias
        g = g.reshape(hidden.shape[0], self.heads, self.shape.head_dim)
        if self.shape.lower_bound is not None:
            return self.shape.lower_bound * sigmoid(self.rate * g)
        return -self.rate * softplus(g)

    def _sequence(self, seq: SequenceRows, qkv: mx.array, g: mx.array, beta: mx.array) -> mx.array:
        """One sequence's n new tokens after its slot's states (then stored back): [n, h, d] float32."""
        history = self.conv_pool[seq.slot]
        q, k, v = self._heads(silu(causal_conv(qkv, history, self.conv_weight, None)).astype(qkv.dtype))
        state = self.state_pool[seq.slot]  # [h, d, d]
        out = []
        for t in range(qkv.shape[0]):
            state = state * mx.exp(g[t])[:, :, None]
            remembered = (state * k[t, :, :, None]).sum(axis=-2)  # [h, d]
            delta = (v[t] - remembered) * beta[t, :, None]
            state = state + k[t, :, :, None] * delta[:, None, :]
            out.append((state * q[t, :, :, None]).sum(axis=-2))
            if t in seq.captures:
                self.capture(seq, t, history_after(history, qkv, t), state)
        self.store(seq.slot, history_after(history, qkv, qkv.shape[0] - 1), state)
        return mx.stack(out)

    def _heads(self, mixed: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The conv output [n, 3 * width] as float32 q, k (l2-normalised, q scaled) and v [n, h, d]."""
        n, d = mixed.shape[0], self.shape.head_dim
        q, k, v = (part.reshape(n, self.heads, d).astype(mx.float32) for part in mx.split(mixed, 3, axis=-1))
        return l2_divide(q) * d**-0.5, l2_divide(k), v

"""Nemotron-H's Mamba2 mixer in MLX: layers/mamba2.py's recurrent form, op for op (its docstring has the
equations), on the state slots of mlx_rank/recurrent.py."""

import mlx.core as mx

from deployments.model_rank.layers.mamba2 import Mamba2Shape
from deployments.model_rank.mlx_rank.batch import MlxBatch
from deployments.model_rank.mlx_rank.layers import Linear, silu, softplus
from deployments.model_rank.mlx_rank.recurrent import (
    RecurrentMixer,
    SequenceRows,
    causal_conv,
    history_after,
    sequence_rows,
)


class GatedGroupRMSNorm:
    """RMSNorm of y * silu(z) over groups of `group_size` features, in float32, times the weight."""

    def __init__(self, weight: mx.array, group_size: int, eps: float) -> None:
        self.weight = weight.astype(mx.float32)  # promoted to float32, as transformers does
        self.group_size, self.eps = group_size, eps
        mx.eval(self.weight)

    def __call__(self, y: mx.array, gate: mx.array) -> mx.array:
        """y [T, I] float32, gate [T, I] -> [T, I] float32."""
        gated = y * silu(gate.astype(mx.float32))
        groups = gated.reshape(gated.shape[0], -1, self.group_size)  # [T, G, I / G]
        groups = groups * mx.rsqrt(mx.mean(groups * groups, axis=-1, keepdims=True) + self.eps)
        return self.weight * groups.reshape(gated.shape)


class Mamba2Mixer(RecurrentMixer):
    """Conv history [K - 1, conv_dim] and SSM state [heads, head_dim, d_state] per sequence slot."""

    def __init__(
        self,
        shape: Mamba2Shape,
        in_proj: Linear,
        conv_weight: mx.array,
        conv_bias: mx.array | None,
        dt_bias: mx.array,
        a_log: mx.array,
        d: mx.array,
        norm: GatedGroupRMSNorm,
        out_proj: Linear,
    ) -> None:
        self.shape, self.in_proj, self.norm, self.out_proj = shape, in_proj, norm, out_proj
        self.conv_weight, self.conv_bias = conv_weight, conv_bias  # [conv_dim, K], [conv_dim]
        self.dt_bias = dt_bias  # [heads] in the model dtype: dt's softplus runs there, as in torch
        self.a = -mx.exp(a_log.astype(mx.float32))  # [heads]
        self.d = d.astype(mx.float32)  # [heads]
        mx.eval(self.a, self.d)  # MLX streams are per thread: not left for the engine's thread

    def __call__(self, hidden: mx.array, batch: MlxBatch) -> mx.array:
        """hidden [T, H] -> [T, H]; advances each sequence's slot."""
        s = self.shape
        projected = self.in_proj(hidden)
        gate, xbc, dt = mx.split(projected, [s.intermediate_size, s.intermediate_size + s.conv_dim], axis=-1)
        parts = [
            self._scan(seq, xbc[seq.start : seq.end], dt[seq.start : seq.end])
            for seq in sequence_rows(batch)
            if seq.end > seq.start
        ]
        y = mx.concatenate(parts)  # [T, I] float32
        return self.out_proj(self.norm(y, gate).astype(hidden.dtype))  # [T, H]

    def _scan(self, seq: SequenceRows, xbc: mx.array, dt: mx.array) -> mx.array:
        """One sequence's new rows: xbc [n, C], dt [n, heads] -> y [n, I] float32."""
        s, n = self.shape, xbc.shape[0]
        history, state = self.conv_pool[seq.slot], self.state_pool[seq.slot]
        conv = causal_conv(xbc, history, self.conv_weight, self.conv_bias)  # [n, C] float32
        # Rounded to the model dtype before silu, where transformers' conv leaves its output.
        grouped = s.n_groups * s.state_size
        mixed = silu(conv.astype(xbc.dtype)).astype(mx.float32)
        x, b, c = mx.split(mixed, [s.intermediate_size, s.intermediate_size + grouped], axis=-1)
        x = x.reshape(n, s.num_heads, s.head_dim)  # [n, heads, head_dim]
        per_group = s.num_heads // s.n_groups
        b = mx.repeat(b.reshape(n, s.n_groups, s.state_size), per_group, axis=1)  # [n, heads, d_state]
        c = mx.repeat(c.reshape(n, s.n_groups, s.state_size), per_group, axis=1)  # [n, heads, d_state]
        y = []
        for row in range(n):
            state, out = self._token(state, x[row], b[row], c[row], dt[row])
            y.append(out)
            if row in seq.captures:
                self.capture(seq, row, history_after(history, xbc, row), state)
        self.store(seq.slot, history_after(history, xbc, n - 1), state)
        return mx.stack(y).reshape(n, s.intermediate_size)

    def _token(self, state: mx.array, x: mx.array, b: mx.array, c: mx.array, dt: mx.array) -> tuple[mx.array, mx.array]:
        """One token: state [heads, head_dim, d_state], x [heads, head_dim], b / c [heads, d_state], dt [heads]
        before its bias -> (the next state, y [heads, head_dim])."""
        step = softplus(dt + self.dt_bias).astype(mx.float32)  # in the model dtype, as transformers computes it
        low, high = self.shape.time_step_limit
        if low > 0.0 or high != float("inf"):
            step = mx.clip(step, low, high)
        state = state * mx.exp(step * self.a)[:, None, None]
        state = state + (x * step[:, None])[:, :, None] * b[:, None, :]
        return state, (state @ c[:, :, None])[:, :, 0] + self.d[:, None] * x

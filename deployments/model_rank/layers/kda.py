"""Kimi delta attention (GLM-5.3-Flash's `linear_attention` layers), as a RecurrentMixer.

For each token, with a state S [head_dim, head_dim] per head:
    q, k, v = silu(causal_conv(q_proj x)), ... (one depthwise conv per projection)
    q, k l2-normalised (x / sqrt(|x|^2 + eps)), q scaled by head_dim ** -0.5;  beta = sigmoid(b_proj x)
    g = lower_bound * sigmoid(exp(A_log) * (f_b(f_a x) + dt_bias))   (one log-decay per key channel)
    S = S * exp(g)[:, None];  S = S + k (x) beta * (v - k S);  o = q S
    out = o_proj(RMSNorm(o) * sigmoid(g_b(g_a x)))
Exactness is Gated DeltaNet's (layers/gated_delta.py): the recurrence runs token after token in float32 per
sequence (kernels/recurrent_scan.kda_scan), the projections are row-invariant. Tensor parallelism splits the
layer by heads: q/k/v, f_b, g_b and b_proj column-parallel, the convs by channel, o_proj row-parallel.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deployments.model_rank.forward_batch import ForwardBatch, LayerStateSpec, ParallelContext
from deployments.model_rank.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from deployments.model_rank.layers.parallel import default_loader, divide, sharded_vector
from deployments.model_rank.layers.recurrent import DepthwiseConv1d, RecurrentMixer, scan_rows
from kernels import dispatch
from kernels.activation import sigmoid, silu

L2_EPS = 1e-6  # q and k l2-normalisation, as the reference has it


@dataclass(frozen=True)
class KdaShape:
    """The linear-attention keys of a GLM-5.3-Flash config (defaults: transformers')."""

    num_heads: int  # linear_num_heads
    head_dim: int  # linear_head_dim (keys and values alike)
    conv_kernel: int  # linear_conv_kernel_dim
    lower_bound: float | None  # linear_lower_bound: the decay's floor (None: -exp(A_log) * softplus)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "KdaShape":
        bound = raw.get("linear_lower_bound", -5.0)
        return cls(
            num_heads=int(raw.get("linear_num_heads", 64)),
            head_dim=int(raw.get("linear_head_dim", 128)),
            conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)),
            lower_bound=None if bound is None else float(bound),
        )

    @property
    def width(self) -> int:
        return self.num_heads * self.head_dim


class SigmoidGatedRMSNorm(nn.Module):
    """RMSNorm(x) * weight * sigmoid(gate), all in float32 and rounded once (KDA's output norm)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.weight.weight_loader = default_loader

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (normed * sigmoid(gate.float())).to(x.dtype)


def l2_divide(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (float32): the reference divides rather than multiplies."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


class KimiDeltaAttention(RecurrentMixer):
    """Conv history [K - 1, 3 * width] and state [heads, head_dim, head_dim] per slot, for this rank's heads."""

    def __init__(self, shape: KdaShape, hidden_size: int, eps: float, parallel: ParallelContext) -> None:
        super().__init__()
        self.heads = divide(shape.num_heads, parallel.tp_size, "linear_num_heads")
        self.shape, self.width = shape, self.heads * shape.head_dim
        for name in ("q", "k", "v"):
            self.add_module(f"{name}_proj", ColumnParallelLinear(hidden_size, shape.width, parallel))
            self.add_module(f"{name}_conv1d", DepthwiseConv1d((shape.width,), shape.conv_kernel, parallel))
        self.A_log = sharded_vector(shape.num_heads, parallel)
        self.dt_bias = sharded_vector(shape.width, parallel)
        self.f_a_proj = ReplicatedLinear(hidden_size, shape.head_dim)
        self.f_b_proj = ColumnParallelLinear(shape.head_dim, shape.width, parallel)
        self.b_proj = ColumnParallelLinear(hidden_size, shape.num_heads, parallel)
        self.g_a_proj = ReplicatedLinear(hidden_size, shape.head_dim)
        self.g_b_proj = ColumnParallelLinear(shape.head_dim, shape.width, parallel)
        self.o_norm = SigmoidGatedRMSNorm(shape.head_dim, eps)
        self.o_proj = RowParallelLinear(shape.width, hidden_size, parallel)

    def state_spec(self) -> LayerStateSpec:
        d = self.shape.head_dim
        return LayerStateSpec((self.shape.conv_kernel - 1, 3 * self.width), (self.heads, d, d))

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        tokens, rows = hidden.shape[0], scan_rows(batch)
        qkv = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], dim=-1)
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0]
        conv = dispatch.causal_conv_scan(qkv, self.conv_pool, weight, None, rows)
        q, k, v = self._heads(silu(conv).to(qkv.dtype))  # silu in float32, as the reference
        beta = sigmoid(self.b_proj(hidden)).float()  # [T, h]
        core = dispatch.kda_scan(self.state_pool, q, k, v, self._log_decay(hidden), beta, rows)
        gate = self.g_b_proj(self.g_a_proj(hidden)).view(tokens, self.heads, -1)
        out = self.o_norm(core.to(hidden.dtype), gate)  # [T, h, d]
        return self.o_proj(out.reshape(tokens, self.width))

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv output [n, 3 * width] as float32 q, k (l2-normalised, q scaled) and v [n, h, d]."""
        n, d = mixed.shape[0], self.shape.head_dim
        q, k, v = (part.reshape(n, self.heads, d).float() for part in mixed.split(self.width, dim=-1))
        return l2_divide(q) * d**-0.5, l2_divide(k), v

    def _log_decay(self, hidden: torch.Tensor) -> torch.Tensor:
        """g [T, h, d] float32: each key channel's log-decay for this token."""
        d = self.shape.head_dim
        g = (self.f_b_proj(self.f_a_proj(hidden)).float() + self.dt_bias.float()).view(-1, self.heads, d)
        rate = self.A_log.float().exp()[None, :, None]
        if self.shape.lower_bound is not None:
            return self.shape.lower_bound * sigmoid(rate * g)
        return -rate * torch.nn.functional.softplus(g)

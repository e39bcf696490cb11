"""The Mamba2 mixer (Nemotron-H's "M" blocks) in its recurrent form, one canonical computation per token.

in_proj splits into the gate z, the conv inputs xBC and dt. xBC runs through the depthwise causal conv after
the slot's last inputs, then silu, and splits into x (heads x head_dim), B and C (n_groups x d_state; head h
reads group h // (heads / n_groups)). Per token, in float32, on the slot's state [heads, head_dim, d_state]:

    dt = clamp(softplus(dt + dt_bias), time_step_limit)    dA = exp(dt * A),  A = -exp(A_log)
    state = state * dA + (dt * x) (outer) B                 y = state . C + D * x

then the group-wise RMSNorm gated by silu(z), and out_proj. The recurrence's ops (softplus, exp, the state
update, y) run on one token's fixed-shape tensors, the conv is elementwise over its taps, and silu is
composed of ops whose bits do not depend on a tensor's size (kernels/activation.py), so a token's bits never
depend on the chunk or batch it arrives in (kernels/recurrent_scan.py). transformers' chunked scan is never used:
its rounding depends on where chunks fall.
"""

from dataclasses import dataclass, replace

import torch
from torch import nn

from deployments.model_rank.forward_batch import ForwardBatch, LayerStateSpec, ParallelContext
from deployments.model_rank.layers.linear import ColumnParallelLinear, RowParallelLinear
from deployments.model_rank.layers.parallel import sharded_vector
from deployments.model_rank.layers.recurrent import DepthwiseConv1d, RecurrentMixer, scan_rows
from kernels import dispatch
from kernels.activation import silu


@dataclass(frozen=True)
class Mamba2Shape:
    """One Mamba2 layer's sizes and options (from config.json)."""

    hidden_size: int
    num_heads: int  # mamba_num_heads
    head_dim: int  # mamba_head_dim
    state_size: int  # ssm_state_size (d_state)
    n_groups: int  # B / C groups, each shared by num_heads / n_groups consecutive heads
    conv_kernel: int
    use_conv_bias: bool
    use_bias: bool  # in_proj / out_proj biases
    norm_eps: float  # the gated group RMSNorm's epsilon
    time_step_limit: tuple[float, float]  # dt is clamped to [low, high] after the softplus

    def per_rank(self, parallel: ParallelContext) -> "Mamba2Shape":
        """This rank's heads and their B / C groups: num_heads / tp_size heads, n_groups / tp_size groups."""
        tp = parallel.tp_size
        if tp == 1:
            return self
        if self.n_groups % tp or self.num_heads % tp:
            raise ValueError(
                f"Mamba2 layers are split by heads with their B / C groups: n_groups ({self.n_groups}) and "
                f"mamba_num_heads ({self.num_heads}) must both divide evenly into {tp} tensor-parallel ranks"
            )
        return replace(self, num_heads=self.num_heads // tp, n_groups=self.n_groups // tp)

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: x, B and C."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size


class GatedGroupRMSNorm(nn.Module):
    """RMSNorm of y * silu(z) over groups of `group_size` features, in float32, times the weight."""

    def __init__(self, size: int, group_size: int, eps: float, parallel: ParallelContext) -> None:
        super().__init__()
        self.group_size = group_size
        self.eps = eps
        self.weight = sharded_vector(size, parallel)  # a rank's whole groups: the norm never crosses ranks

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """y [T, I] float32, gate [T, I] -> [T, I] float32."""
        gated = y * silu(gate.float())
        groups = gated.view(gated.shape[0], -1, self.group_size)  # [T, G, I / G]
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * groups.view_as(gated)  # the weight promoted to float32, as transformers does


class Mamba2Mixer(RecurrentMixer):
    """Mamba2 over a step's rows, each sequence from its state slot (conv history and SSM state).

    Tensor parallelism splits it by heads with their B / C groups (`Mamba2Shape.per_rank`): in_proj's
    z | x | B | C | dt blocks, the conv's x | B | C channels, dt_bias, A_log, D and the group norm's weight
    are sharded block by block; out_proj is row-parallel (its all-reduce sums the ranks' heads).
    """

    def __init__(self, shape: Mamba2Shape, parallel: ParallelContext) -> None:
        super().__init__()
        self.shape = shape.per_rank(parallel)
        inner, heads, grouped = shape.intermediate_size, shape.num_heads, shape.n_groups * shape.state_size
        projected = (inner, inner, grouped, grouped, heads)  # z, x, B, C, dt
        self.in_proj = ColumnParallelLinear(
            shape.hidden_size, sum(projected), parallel, bias=shape.use_bias, parts=projected
        )
        self.conv1d = DepthwiseConv1d((inner, grouped, grouped), shape.conv_kernel, parallel, shape.use_conv_bias)
        self.dt_bias = sharded_vector(heads, parallel)
        self.A_log = sharded_vector(heads, parallel)
        self.D = sharded_vector(heads, parallel)
        self.norm = GatedGroupRMSNorm(inner, inner // shape.n_groups, shape.norm_eps, parallel)
        self.out_proj = RowParallelLinear(inner, shape.hidden_size, parallel, bias=shape.use_bias)

    def state_spec(self) -> LayerStateSpec:
        s = self.shape
        return LayerStateSpec(
            conv_shape=(s.conv_kernel - 1, s.conv_dim), recurrent_shape=(s.num_heads, s.head_dim, s.state_size)
        )

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """hidden [T, H] -> [T, H]; advances each sequence's slot in place."""
        s, rows = self.shape, scan_rows(batch)
        gate, xbc, dt = self.in_proj(hidden).split([s.intermediate_size, s.conv_dim, s.num_heads], dim=-1)
        conv = dispatch.causal_conv_scan(xbc, self.conv_pool, self.conv1d.weight[:, 0], self.conv1d.bias, rows)
        # Rounded to the model dtype before silu, where transformers' conv leaves its output.
        grouped = s.n_groups * s.state_size
        x, b, c = silu(conv.to(xbc.dtype)).float().split([s.intermediate_size, grouped, grouped], dim=-1)
        x = x.reshape(-1, s.num_heads, s.head_dim)  # [T, heads, head_dim]
        per_group = s.num_heads // s.n_groups
        b = b.reshape(-1, s.n_groups, s.state_size).repeat_interleave(per_group, dim=1)  # [T, heads, d_state]
        c = c.reshape(-1, s.n_groups, s.state_size).repeat_interleave(per_group, dim=1)  # [T, heads, d_state]
        a, d = -torch.exp(self.A_log.float()), self.D.float()  # [heads] each
        y = dispatch.mamba2_scan(self.state_pool, x, b, c, dt, self.dt_bias, a, d, s.time_step_limit, rows)
        y = y.reshape(hidden.shape[0], s.intermediate_size)
        return self.out_proj(self.norm(y, gate).to(hidden.dtype))  # [T, H]

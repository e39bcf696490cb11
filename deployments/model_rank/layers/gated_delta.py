"""The Gated DeltaNet mixer of Qwen3-Next and Qwen3.5 (their `linear_attn` layers), as a RecurrentMixer.

For each token of a sequence, with S [key_dim, value_dim] per value head (each key head serves a group of
value heads, num_v_heads / num_k_heads of them):
    q, k, v = split(silu(causal_conv(in_proj(x))));  q, k l2-normalised, q scaled by key_dim ** -0.5
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)
    S = S * exp(g);  S = S + k (x) beta * (v - k S);  o = q S
    out = out_proj(RMSNorm(o) * silu(z))
Exactness (docs/engine.md): the recurrence runs token after token in float32 for each sequence on its own,
never in transformers' chunked form (kernels/recurrent_scan.py), so a token's result is the same whatever chunk or batch it came in;
ops over a step's rows are row-wise (projections through `invariant_linear`, activations from
kernels/activation.py whose bits do not depend on an element's place in the tensor).
"""

from dataclasses import dataclass, replace
from typing import Any

import torch

from deployments.model_rank.forward_batch import ForwardBatch, LayerStateSpec, ParallelContext
from deployments.model_rank.layers.linear import ColumnParallelLinear, RowParallelLinear
from deployments.model_rank.layers.norm import GatedRMSNorm
from deployments.model_rank.layers.parallel import sharded_vector
from deployments.model_rank.layers.recurrent import DepthwiseConv1d, RecurrentMixer, scan_rows
from kernels import dispatch
from kernels.activation import sigmoid, silu

L2_EPS = 1e-6  # q and k l2-normalisation, as transformers has it


@dataclass(frozen=True)
class GatedDeltaNetShape:
    """The linear-attention keys of a Qwen3-Next / Qwen3.5 config.json (defaults: transformers')."""

    num_k_heads: int  # linear_num_key_heads: query and key heads
    num_v_heads: int  # linear_num_value_heads: value heads, a whole number of them per key head
    head_k_dim: int  # linear_key_head_dim
    head_v_dim: int  # linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim: taps of the causal conv over q, k and v

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "GatedDeltaNetShape":
        shape = cls(
            num_k_heads=int(raw.get("linear_num_key_heads", 16)),
            num_v_heads=int(raw.get("linear_num_value_heads", 32)),
            head_k_dim=int(raw.get("linear_key_head_dim", 128)),
            head_v_dim=int(raw.get("linear_value_head_dim", 128)),
            conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)),
        )
        if shape.num_v_heads % shape.num_k_heads:
            raise ValueError(f"linear_num_value_heads ({shape.num_v_heads}) is not a multiple of linear_num_key_heads")
        return shape

    def per_rank(self, parallel: ParallelContext) -> "GatedDeltaNetShape":
        """The heads this rank holds: num_k_heads / tp_size key heads, each with its group of value heads."""
        if parallel.tp_size == 1:
            return self
        if self.num_k_heads % parallel.tp_size:
            raise ValueError(
                f"linear_num_key_heads ({self.num_k_heads}) does not divide evenly into {parallel.tp_size} "
                "tensor-parallel ranks: Gated DeltaNet layers are split by key heads"
            )
        return replace(
            self, num_k_heads=self.num_k_heads // parallel.tp_size, num_v_heads=self.num_v_heads // parallel.tp_size
        )

    @property
    def group(self) -> int:
        """Value heads per key head."""
        return self.num_v_heads // self.num_k_heads

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """The conv's channels: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    """x / |x| over the last dim (float32)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


class GatedDeltaNet(RecurrentMixer):
    """Conv history [K - 1, conv_dim] and state [num_v_heads, head_k_dim, head_v_dim] per sequence slot, for
    this rank's heads (`shape`): tensor parallelism splits the layer by key heads, each rank holding its key
    heads' q and k, their value heads' v, z, b, a, A_log and dt_bias, and its share of the conv's q | k | v
    channels; out_proj is row-parallel (its all-reduce sums the ranks' heads), the per-head norm replicated.

    Subclasses read the checkpoint's input projections (`project`); the rest is shared.
    """

    def __init__(self, shape: GatedDeltaNetShape, hidden_size: int, eps: float, parallel: ParallelContext) -> None:
        super().__init__()
        self.shape = shape.per_rank(parallel)
        qkv_parts = (shape.key_dim, shape.key_dim, shape.value_dim)
        self.conv1d = DepthwiseConv1d(qkv_parts, shape.conv_kernel, parallel)
        self.A_log = sharded_vector(shape.num_v_heads, parallel)
        self.dt_bias = sharded_vector(shape.num_v_heads, parallel)
        self.norm = GatedRMSNorm(shape.head_v_dim, eps)
        self.out_proj = RowParallelLinear(shape.value_dim, hidden_size, parallel)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (qkv [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv]) in the model dtype."""
        raise NotImplementedError

    def state_spec(self) -> LayerStateSpec:
        s = self.shape
        return LayerStateSpec((self.conv1d.history_len, s.conv_dim), (s.num_v_heads, s.head_k_dim, s.head_v_dim))

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        tokens, s, rows = hidden.shape[0], self.shape, scan_rows(batch)
        qkv, z, b, a = self.project(hidden)
        conv = dispatch.causal_conv_scan(qkv, self.conv_pool, self.conv1d.weight[:, 0], self.conv1d.bias, rows)
        q, k, v = self._heads(silu(conv.to(qkv.dtype)))
        neg_a = -self.A_log.float().exp()  # [Hv]
        beta = sigmoid(b).float()  # [T, Hv]
        core = dispatch.gated_delta_scan(self.state_pool, q, k, v, a, beta, neg_a, self.dt_bias, rows)
        out = self.norm(core.to(hidden.dtype), z)  # [T, Hv, Dv]
        return self.out_proj(out.reshape(tokens, s.value_dim))  # [T, H]

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv output [n, conv_dim] as float32 q, k [n, Hv, Dk] (each key head repeated over its value
        heads, l2-normalised, q scaled) and v [n, Hv, Dv]."""
        s, n = self.shape, mixed.shape[0]
        q, k, v = mixed.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q = l2_normalise(q.reshape(n, s.num_k_heads, s.head_k_dim).float()) * s.head_k_dim**-0.5
        k = l2_normalise(k.reshape(n, s.num_k_heads, s.head_k_dim).float())
        if s.group > 1:
            q, k = q.repeat_interleave(s.group, dim=1), k.repeat_interleave(s.group, dim=1)
        return q, k, v.reshape(n, s.num_v_heads, s.head_v_dim).float()


class GroupedProjectionDeltaNet(GatedDeltaNet):
    """Qwen3-Next's input projections: `in_proj_qkvz` and `in_proj_ba`, their rows laid out key head by key
    head ([q, k, the group's v, the group's z] and [the group's b, the group's a])."""

    def __init__(self, shape: GatedDeltaNetShape, hidden_size: int, eps: float, parallel: ParallelContext) -> None:
        super().__init__(shape, hidden_size, eps, parallel)
        # Rows grouped by key head: a contiguous shard is whole key heads with their groups.
        self.in_proj_qkvz = ColumnParallelLinear(hidden_size, 2 * shape.key_dim + 2 * shape.value_dim, parallel)
        self.in_proj_ba = ColumnParallelLinear(hidden_size, 2 * shape.num_v_heads, parallel)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        s, tokens = self.shape, hidden.shape[0]
        group_v = s.group * s.head_v_dim
        qkvz = self.in_proj_qkvz(hidden).reshape(tokens, s.num_k_heads, -1)
        q, k, v, z = qkvz.split([s.head_k_dim, s.head_k_dim, group_v, group_v], dim=-1)
        b, a = self.in_proj_ba(hidden).reshape(tokens, s.num_k_heads, -1).split([s.group, s.group], dim=-1)
        qkv = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=-1)
        z = z.reshape(tokens, s.num_v_heads, s.head_v_dim)
        return qkv, z, b.reshape(tokens, s.num_v_heads), a.reshape(tokens, s.num_v_heads)


class SplitProjectionDeltaNet(GatedDeltaNet):
    """Qwen3.5's input projections: `in_proj_qkv` (all q, then all k, then all v), `in_proj_z`, `in_proj_b`
    and `in_proj_a`."""

    def __init__(self, shape: GatedDeltaNetShape, hidden_size: int, eps: float, parallel: ParallelContext) -> None:
        super().__init__(shape, hidden_size, eps, parallel)
        qkv_parts = (shape.key_dim, shape.key_dim, shape.value_dim)
        self.in_proj_qkv = ColumnParallelLinear(hidden_size, shape.conv_dim, parallel, parts=qkv_parts)
        self.in_proj_z = ColumnParallelLinear(hidden_size, shape.value_dim, parallel)
        self.in_proj_b = ColumnParallelLinear(hidden_size, shape.num_v_heads, parallel)
        self.in_proj_a = ColumnParallelLinear(hidden_size, shape.num_v_heads, parallel)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        z = self.in_proj_z(hidden).reshape(hidden.shape[0], self.shape.num_v_heads, self.shape.head_v_dim)
        return self.in_proj_qkv(hidden), z, self.in_proj_b(hidden), self.in_proj_a(hidden)

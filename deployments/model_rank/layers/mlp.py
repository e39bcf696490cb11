"""The feed-forward blocks: gated SiLU (dense layers and shared experts) and relu^2 (Nemotron-H)."""

import torch
import torch.nn.functional as F
from torch import nn

from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.layers.linear import ColumnParallelLinear, FusedProjection, RowParallelLinear
from kernels import dispatch


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); intermediate features sharded across ranks.

    `reduce=False` leaves the partial sum for the caller to all-reduce together with other partial sums.
    `limit` (GLM-5.3's swiglu_limit): gate clamped to at most limit and up to [-limit, limit] first.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelContext,
        bias: bool = False,
        reduce: bool = True,
        limit: float | None = None,
    ) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, parallel, bias=bias)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, parallel, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, parallel, bias=bias, reduce=reduce)
        self.gate_up: FusedProjection | None = None  # set after packing (layers/packing.py)

    def fuse_projections(self) -> bool:
        """One GEMM call for gate and up where their packed weights allow it."""
        if FusedProjection.fits([self.gate_proj, self.up_proj]):
            self.gate_up = FusedProjection([self.gate_proj, self.up_proj])
        return self.gate_up is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x)  # [T, I] halves of one [T, 2I] output
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.down_proj(dispatch.silu_mul(gate, up))  # [T, H]


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2: exact elementwise ops, so a row's result never depends on the tensor around it."""
    return torch.square(F.relu(x))


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x))^2), no gate (Nemotron-H's MLP blocks and shared experts); intermediate features
    sharded across ranks."""

    def __init__(self, hidden_size: int, intermediate_size: int, parallel: ParallelContext, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, parallel, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, parallel, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu_squared(self.up_proj(x)))  # [T, H]

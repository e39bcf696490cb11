"""Nemotron-H's mixture of experts: relu^2 experts without a gate, optionally run in a smaller latent space,
beside an always-on relu^2 shared expert; routed by layers/moe.py's grouped sigmoid Router.

Row-invariant like layers/moe.py: routing is per token, each expert runs the batch-invariant linear over the
rows routed to it, and a token's k weighted outputs are summed in slot order, in float32, from its own slots
(kernels/fused_moe.py: the Triton grouped GEMM on CUDA, `relu2_moe_torch` elsewhere).
"""

import torch
from torch import nn

from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.layers.linear import ReplicatedLinear, invariant_linear
from deployments.model_rank.layers.mlp import ReluSquaredMLP
from deployments.model_rank.layers.moe import Router, RoutingConfig, stacked_expert_param
from deployments.model_rank.layers.parallel import all_reduce, divide
from kernels import dispatch


class ReluSquaredExperts(nn.Module):
    """E experts down(relu(up(x))^2) stored stacked: up [E, I/tp, D], down [E, D, I/tp] (D: the hidden or
    latent size). Loads per-expert hub tensors (`experts.{e}.up_proj.weight`) or transformers' stacked
    `experts.up_proj` / `experts.down_proj`."""

    def __init__(self, num_experts: int, input_size: int, intermediate_size: int, parallel: ParallelContext) -> None:
        super().__init__()
        local = divide(intermediate_size, parallel.tp_size, "expert intermediate size")
        self.up_proj = stacked_expert_param(num_experts, local, input_size, 0, parallel)
        self.down_proj = stacked_expert_param(num_experts, input_size, local, 1, parallel)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, D], weights (float32) / ids [T, k] -> [T, D] in x's dtype (this rank's partial sum under TP):
        on CUDA the fused grouped GEMM (no host read of the routing), on CPU each expert over its rows."""
        return dispatch.moe_experts(x, weights, ids, None, self.up_proj, self.down_proj, invariant_linear)


class LatentMoE(nn.Module):
    """gate -> [fc1_latent_proj] -> routed experts -> [fc2_latent_proj], plus shared_experts(x), named as the
    checkpoints name them. The router and the shared expert read the block's input, not the latent.

    Tensor parallelism shards the experts' and the shared expert's intermediate features. The routed partial
    sums are all-reduced before the replicated fc2_latent_proj (so its bias is added once, and at one rank
    the computation is unchanged); the shared expert, row-parallel, reduces its own.
    """

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        shared_intermediate_size: int,
        latent_size: int | None,
        routing: RoutingConfig,
        parallel: ParallelContext,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.gate = Router(hidden_size, routing)
        inner = latent_size or hidden_size
        self.experts = ReluSquaredExperts(routing.num_experts, inner, moe_intermediate_size, parallel)
        self.shared_experts = ReluSquaredMLP(hidden_size, shared_intermediate_size, parallel, bias=bias)
        self.fc1_latent_proj = ReplicatedLinear(hidden_size, latent_size, bias) if latent_size else None
        self.fc2_latent_proj = ReplicatedLinear(latent_size, hidden_size, bias) if latent_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # [T, k] each
        inner = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x  # [T, D]
        routed = all_reduce(self.experts(inner, weights, ids), self.parallel)  # [T, D], the ranks' sum
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)  # [T, H]
        return routed + self.shared_experts(x)  # [T, H]

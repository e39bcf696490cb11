"""Mixture-of-experts: routers (Qwen3 softmax top-k, GLM grouped sigmoid, Gemma 4's scaled softmax), experts,
the sparse blocks.

Every token's result is independent of its neighbours: routing is row-wise, each expert runs the
batch-invariant linear over the rows routed to it, and the k expert outputs of a token are summed in its
own slot order from a [T, k, H] buffer (never scattered into a shared accumulator).
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.layers.linear import ReplicatedLinear, invariant_linear
from deployments.model_rank.layers.mlp import GatedMLP
from deployments.model_rank.layers.norm import unscaled_rms_norm
from deployments.model_rank.layers.parallel import all_reduce, copy_shard, default_loader, divide
from kernels import dispatch
from kernels.activation import sigmoid


@dataclass(frozen=True)
class RoutingConfig:
    num_experts: int
    top_k: int
    scoring: str = "softmax"  # "softmax" (Qwen3-MoE) or "sigmoid" (GLM: correction bias, groups, scaling)
    norm_topk_prob: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    @classmethod
    def grouped_sigmoid(cls, raw: dict[str, Any], experts: int, top_k: int, scaling: float) -> "RoutingConfig":
        """GLM's routing keys (GLM-4.5 to 4.7, GLM-4.7-Flash, Nemotron-H's MoE blocks), with the family's
        transformers defaults for the expert count, `top_k` and the scaling factor."""
        routing = cls(
            num_experts=int(_first(raw, EXPERT_COUNT_KEYS, experts)),
            top_k=int(_first(raw, ("num_experts_per_tok",), top_k)),
            scoring="sigmoid",
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", scaling)),
        )
        routing.check(EXPERT_COUNT_KEYS[0])
        return routing

    def check(self, experts_key: str) -> None:
        """Refuse at load a routing no step could run (the router's top-k and group views would fail on the
        first MoE step), naming config.json's keys; `experts_key` is the family's name for the expert count."""
        experts = f"{experts_key} ({self.num_experts})"
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and {experts}")
        if self.scoring != "sigmoid":
            return
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide {experts} into equal groups")
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError(f"n_group ({self.n_group}) leaves groups of one expert: a group scores its best two")
        if not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be between 1 and n_group ({self.n_group})")


EXPERT_COUNT_KEYS = ("n_routed_experts", "num_local_experts")  # GLM's spelling, then another export's


def _first(raw: dict[str, Any], keys: tuple[str, ...], default: Any) -> Any:
    return next((raw[key] for key in keys if raw.get(key) is not None), default)


class Router(nn.Module):
    """Scores experts per token and returns (weights [T, k], expert ids [T, k]), best first."""

    def __init__(self, hidden_size: int, routing: RoutingConfig) -> None:
        super().__init__()
        self.routing = routing
        self.weight = nn.Parameter(torch.empty(routing.num_experts, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_loader
        self.e_score_correction_bias = None
        if routing.scoring == "sigmoid":
            bias = torch.zeros(routing.num_experts, dtype=torch.float32)  # kept in float32, as trained
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
            self.e_score_correction_bias.weight_loader = default_loader

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.routing.scoring == "sigmoid":
            return self._grouped_sigmoid(x)
        return self._softmax(x)

    def _softmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = invariant_linear(x, self.weight)  # [T, E] in the model dtype
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.routing.top_k, dim=-1)  # [T, k]
        if self.routing.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids

    def _grouped_sigmoid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.routing
        logits = invariant_linear(x.float(), self.weight.float())  # [T, E] float32
        return dispatch.grouped_topk(
            logits,
            self.e_score_correction_bias,
            r.top_k,
            r.n_group,
            r.topk_group,
            r.norm_topk_prob,
            r.routed_scaling_factor,
        )


class ScaledSoftmaxRouter(nn.Module):
    """Gemma 4's router: the token RMS-normed (no weight), times a learned scale and 1/sqrt(H); a softmax over
    the experts (float32), the top k renormalised, each times its expert's learned scale. Returns float32
    (weights [T, k], ids [T, k]); checkpoint names `router.proj`, `router.scale`, `router.per_expert_scale`."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        self.top_k, self.eps, self.root = top_k, eps, hidden_size**-0.5
        self.proj = ReplicatedLinear(hidden_size, num_experts)
        self.scale = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.scale.weight_loader = default_loader
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts), requires_grad=False)
        self.per_expert_scale.weight_loader = default_loader

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.proj(unscaled_rms_norm(x, self.eps) * self.scale * self.root)  # [T, E] in the model dtype
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


def stacked_expert_param(experts: int, rows: int, cols: int, shard_dim: int, parallel: ParallelContext) -> nn.Parameter:
    """One projection of every expert, stacked [E, rows, cols] (this rank's shard of dim `shard_dim` of each
    expert's [rows, cols]); it loads per-expert tensors or one fused [E, ...] tensor."""
    param = nn.Parameter(torch.empty(experts, rows, cols), requires_grad=False)

    def load(p: torch.Tensor, loaded: torch.Tensor, expert_id: int | None = None) -> None:
        # expert_id None: a fused [E, ...] tensor for every expert at once.
        if expert_id is None:
            copy_shard(p, loaded, shard_dim + 1, parallel.tp_rank, parallel.tp_size)
        else:
            copy_shard(p[expert_id], loaded, shard_dim, parallel.tp_rank, parallel.tp_size)

    param.weight_loader = load
    param.expert_count = experts  # the weight loader checks every expert arrives
    return param


class Experts(nn.Module):
    """E gated experts stored stacked: gate/up [E, I/tp, H], down [E, H, I/tp]; the gate's activation is SiLU, or
    GELU-tanh (Gemma 4's, `activation="gelu_tanh"`).

    Loads per-expert hub tensors (`experts.{e}.gate_proj.weight`, ...) or the fused transformers layout
    (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelContext,
        activation: str = "silu",
        swiglu_limit: float | None = None,
    ) -> None:
        super().__init__()
        self.activation, self.swiglu_limit = activation, swiglu_limit
        local = divide(intermediate_size, parallel.tp_size, "expert intermediate size")
        self.gate_proj = stacked_expert_param(num_experts, local, hidden_size, 0, parallel)
        self.up_proj = stacked_expert_param(num_experts, local, hidden_size, 0, parallel)
        self.down_proj = stacked_expert_param(num_experts, hidden_size, local, 1, parallel)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] -> [T, H] (this rank's partial sum under TP)."""
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        limit = self.swiglu_limit
        return dispatch.moe_experts(x, weights, ids, *projections, invariant_linear, self.activation, limit)


class SparseMoE(nn.Module):
    """Router + routed experts (+ optional shared experts), one all-reduce for the sum of both."""

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        routing: RoutingConfig,
        parallel: ParallelContext,
        shared_intermediate_size: int = 0,
        swiglu_limit: float | None = None,
    ) -> None:
        super().__init__()
        self.parallel, self.swiglu_limit = parallel, swiglu_limit
        self.gate = Router(hidden_size, routing)
        args = (routing.num_experts, hidden_size, moe_intermediate_size, parallel)
        self.experts = Experts(*args, swiglu_limit=swiglu_limit)
        self.shared_experts: GatedMLP | None = None
        if shared_intermediate_size:
            self.add_shared(hidden_size, shared_intermediate_size)

    def add_shared(self, hidden_size: int, intermediate_size: int) -> None:
        """The experts every token runs besides its routed ones (this rank's partial sum under TP)."""
        self.shared_experts = GatedMLP(
            hidden_size, intermediate_size, self.parallel, reduce=False, limit=self.swiglu_limit
        )

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if self.shared_experts is None else self.shared_experts(x)  # [T, H]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)  # [T, H]
        shared = self.shared(x)
        if shared is not None:
            out = out + shared
        return all_reduce(out, self.parallel)


class SharedExpertGateMoE(SparseMoE):
    """Qwen3-Next / Qwen3.5-MoE: one shared expert whose output each token scales by
    sigmoid(shared_expert_gate(x)) (checkpoint names `shared_expert.*`, `shared_expert_gate`)."""

    def add_shared(self, hidden_size: int, intermediate_size: int) -> None:
        self.shared_expert = GatedMLP(hidden_size, intermediate_size, self.parallel, reduce=False)
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)  # replicated: it scales each rank's partial sum

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        return sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # [T, 1] * [T, H]

"""Qwen3-MoE: Qwen3 attention with softmax top-k routed experts (no shared expert)."""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.layers.mlp import GatedMLP
from deployments.model_rank.layers.moe import RoutingConfig, SparseMoE
from deployments.model_rank.layers.rotary import RotaryEmbedding
from deployments.model_rank.models.base import CausalLM, DecoderConfig, require
from deployments.model_rank.models.qwen3 import qwen3_attention, reject_sliding_window


@dataclass
class Qwen3MoeConfig(DecoderConfig):
    intermediate_size: int  # dense layers (mlp_only_layers / off the sparse step)
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: list[int]

    def __post_init__(self) -> None:
        if self.num_experts:  # refused at load, not on the first MoE step (0: a dense model, no router)
            self.routing().check("num_experts")

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Qwen3MoeConfig":
        reject_sliding_window(raw)
        return cls(**DecoderConfig.common(raw, max_positions=32768, eps=1e-6), **cls.moe_keys(raw))

    @staticmethod
    def moe_keys(raw: dict[str, Any], default_norm_topk: bool = False) -> dict[str, Any]:
        """The expert fields from config.json (Qwen3-Next and Qwen3.5-MoE read the same keys)."""
        return dict(
            intermediate_size=int(raw.get("intermediate_size") or 0),
            moe_intermediate_size=int(require(raw, "moe_intermediate_size")),
            num_experts=int(require(raw, "num_experts", "num_local_experts")),
            num_experts_per_tok=int(require(raw, "num_experts_per_tok")),
            norm_topk_prob=bool(raw.get("norm_topk_prob", default_norm_topk)),
            decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
            mlp_only_layers=[int(i) for i in raw.get("mlp_only_layers") or []],
        )

    def is_sparse(self, layer: int) -> bool:
        on_step = (layer + 1) % self.decoder_sparse_step == 0
        return layer not in self.mlp_only_layers and self.num_experts > 0 and on_step

    def routing(self) -> RoutingConfig:
        return RoutingConfig(self.num_experts, self.num_experts_per_tok, "softmax", self.norm_topk_prob)

    def mlp(self, layer: int, parallel: ParallelContext) -> nn.Module:
        """The layer's routed experts, or its dense MLP off the sparse step."""
        if self.is_sparse(layer):
            return self.experts(parallel)
        return GatedMLP(self.hidden_size, self.intermediate_size, parallel)

    def experts(self, parallel: ParallelContext) -> nn.Module:
        return SparseMoE(self.hidden_size, self.moe_intermediate_size, self.routing(), parallel)


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(
        self, cfg: Qwen3MoeConfig, parallel: ParallelContext, dtype: torch.dtype, tensor_names: frozenset[str]
    ) -> None:
        super().__init__()
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
        layers = [
            cfg.layer(qwen3_attention(cfg, rotary, parallel), cfg.mlp(index, parallel))
            for index in range(cfg.num_hidden_layers)
        ]
        self.stack(cfg, layers, "qwen3_moe", dtype)

"""GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3-style MLA attention over a latent KV cache, GLM routing
with shared experts, dense layers where `mlp_layer_types` (or `first_k_dense_replace`) says so."""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.layers.decoder import DecoderLayer, DecoderStack
from deployments.model_rank.layers.mla import MLAAttention, MLADims
from deployments.model_rank.layers.mlp import GatedMLP
from deployments.model_rank.layers.moe import RoutingConfig, SparseMoE
from deployments.model_rank.layers.rotary import RotaryEmbedding, mla_softmax_scale
from deployments.model_rank.models.base import CausalLM, DecoderConfig, require
from deployments.model_rank.models.glm4_moe import is_extra_mtp_layer
from deployments.model_rank.weights import WeightTarget


@dataclass
class Glm4MoeLiteConfig(DecoderConfig):
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    mlp_layer_types: list[str]  # "dense" or "sparse" per layer
    num_nextn_predict_layers: int  # MTP layers in the checkpoint; skipped here

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Glm4MoeLiteConfig":
        layers = int(require(raw, "num_hidden_layers"))
        rope_dim = int(require(raw, "qk_rope_head_dim"))
        types = raw.get("mlp_layer_types")
        if types is None:
            dense = int(raw.get("first_k_dense_replace", 1))
            types = ["dense" if i < dense else "sparse" for i in range(layers)]
        if len(types) != layers or set(types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types {types} does not give dense/sparse for each of {layers} layers")
        q_lora = raw.get("q_lora_rank")
        return cls(
            **DecoderConfig.common(raw, max_positions=202752, eps=1e-5, default_head_dim=rope_dim),
            intermediate_size=int(require(raw, "intermediate_size")),
            moe_intermediate_size=int(require(raw, "moe_intermediate_size")),
            n_routed_experts=int(require(raw, "n_routed_experts", "num_local_experts")),
            num_experts_per_tok=int(require(raw, "num_experts_per_tok")),
            n_shared_experts=int(raw.get("n_shared_experts", 1)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.8)),
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            q_lora_rank=int(q_lora) if q_lora is not None else None,
            kv_lora_rank=int(require(raw, "kv_lora_rank")),
            qk_nope_head_dim=int(require(raw, "qk_nope_head_dim")),
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(require(raw, "v_head_dim")),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            mlp_layer_types=list(types),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
        )

    def mla_dims(self) -> MLADims:
        return MLADims(
            hidden_size=self.hidden_size,
            num_heads=self.num_attention_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            attention_bias=self.attention_bias,
        )

    def routing(self) -> RoutingConfig:
        return RoutingConfig(
            num_experts=self.n_routed_experts,
            top_k=self.num_experts_per_tok,
            scoring="sigmoid",
            norm_topk_prob=self.norm_topk_prob,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
        )


class Glm4MoeLiteForCausalLM(CausalLM):
    def __init__(
        self, cfg: Glm4MoeLiteConfig, parallel: ParallelContext, dtype: torch.dtype, tensor_names: frozenset[str]
    ) -> None:
        super().__init__()
        self.num_nextn_predict_layers = cfg.num_nextn_predict_layers
        rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope, cfg.max_position_embeddings, cfg.rope_interleave)
        scale = mla_softmax_scale(cfg.rope, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        layers = []
        for kind in cfg.mlp_layer_types:
            mlp: nn.Module
            if kind == "sparse":
                mlp = SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.routing(), parallel, shared)
            else:
                mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, parallel)
            attn = MLAAttention(cfg.mla_dims(), rotary, scale, parallel)
            layers.append(DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps))
        self.model = DecoderStack(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps)
        self.finish_init(cfg, "glm4_moe_lite", dtype)

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        if is_extra_mtp_layer(name, self.config.num_hidden_layers, self.num_nextn_predict_layers):
            return None  # the checkpoint's MTP layer is not used by this architecture here
        return super().checkpoint_target(name)

"""GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3-style MLA attention over a latent KV cache, GLM routing
with shared experts, dense layers where `mlp_layer_types` (or `first_k_dense_replace`) says so."""

from dataclasses import dataclass
from typing import Any

import torch

from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.layers.mla import MLAAttention, MLADims
from deployments.model_rank.layers.rotary import RotaryEmbedding, mla_softmax_scale
from deployments.model_rank.models.base import CausalLM, DecoderConfig, require
from deployments.model_rank.models.glm4_moe import GlmExpertsConfig, is_extra_mtp_layer
from deployments.model_rank.weights import WeightTarget


@dataclass
class Glm4MoeLiteConfig(GlmExpertsConfig):
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
        return cls(**cls.lite_keys(raw, first_dense=1, experts=(64, 4, 1.8)))

    @staticmethod
    def lite_keys(raw: dict[str, Any], first_dense: int, experts: tuple[int, int, float]) -> dict[str, Any]:
        """The fields as keyword arguments; `first_dense` and `experts` (count, top-k, scaling): the family's
        transformers defaults."""
        layers = int(require(raw, "num_hidden_layers"))
        rope_dim = int(require(raw, "qk_rope_head_dim"))
        types = raw.get("mlp_layer_types")
        if types is None:
            dense = int(raw.get("first_k_dense_replace", first_dense))
            types = ["dense" if i < dense else "sparse" for i in range(layers)]
        if len(types) != layers or set(types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types {types} does not give dense/sparse for each of {layers} layers")
        q_lora = raw.get("q_lora_rank")
        count, top_k, scaling = experts
        return dict(
            **DecoderConfig.common(raw, max_positions=202752, eps=1e-5, default_head_dim=rope_dim or None),
            **GlmExpertsConfig.expert_keys(raw, experts=count, top_k=top_k, scaling=scaling),
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


class Glm4MoeLiteForCausalLM(CausalLM):
    def __init__(
        self, cfg: Glm4MoeLiteConfig, parallel: ParallelContext, dtype: torch.dtype, tensor_names: frozenset[str]
    ) -> None:
        super().__init__()
        self.num_nextn_predict_layers = cfg.num_nextn_predict_layers
        rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope, cfg.max_position_embeddings, cfg.rope_interleave)
        scale = mla_softmax_scale(cfg.rope, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        layers = [
            cfg.layer(MLAAttention(cfg.mla_dims(), rotary, scale, parallel), cfg.mlp(kind == "sparse", parallel))
            for kind in cfg.mlp_layer_types
        ]
        self.stack(cfg, layers, "glm4_moe_lite", dtype)

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        if is_extra_mtp_layer(name, self.config.num_hidden_layers, self.num_nextn_predict_layers):
            return None  # the checkpoint's MTP layer is not used by this architecture here
        return super().checkpoint_target(name)

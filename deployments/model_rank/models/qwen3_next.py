"""Qwen3-Next (`qwen3_next`): Gated DeltaNet layers beside gated full-attention layers (`layer_types`, or
every `full_attention_interval`-th layer), zero-centred RMSNorms, partial RoPE, and routed experts with a
sigmoid-gated shared expert.

The hybrid stack here (`HybridConfig`, `HybridQwenForCausalLM`) also builds Qwen3.5 (models/qwen3_5.py),
which differs in its Gated DeltaNet input projections and in where config.json and the weights keep the
language model. The multi-token-prediction weights (`mtp.*`) are not loaded.
"""

from dataclasses import dataclass
from typing import Any, Self

import torch
from torch import nn

from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.layers.attention import GatedSelfAttention
from deployments.model_rank.layers.decoder import DecoderLayer, DecoderStack
from deployments.model_rank.layers.gated_delta import GatedDeltaNet, GatedDeltaNetShape, GroupedProjectionDeltaNet
from deployments.model_rank.layers.moe import SharedExpertGateMoE
from deployments.model_rank.layers.norm import ZeroCentredRMSNorm
from deployments.model_rank.layers.rotary import RotaryEmbedding
from deployments.model_rank.models.base import CausalLM, DecoderConfig
from deployments.model_rank.models.qwen3_moe import Qwen3MoeConfig
from deployments.model_rank.weights import WeightTarget

RECURRENT, ATTENTION = "linear_attention", "full_attention"  # config.json's layer_types


def hybrid_layer_types(raw: dict[str, Any], num_layers: int) -> list[str]:
    """`layer_types`, or (older configs) full attention every `full_attention_interval` layers (default 4)."""
    types = raw.get("layer_types")
    if types is None:
        interval = int(raw.get("full_attention_interval") or 4)
        types = [ATTENTION if (i + 1) % interval == 0 else RECURRENT for i in range(num_layers)]
    unknown = sorted(set(types) - {RECURRENT, ATTENTION})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported ({RECURRENT}, {ATTENTION})")
    if len(types) != num_layers:
        raise ValueError(f"layer_types lists {len(types)} layers for num_hidden_layers={num_layers}")
    return list(types)


@dataclass
class HybridConfig(Qwen3MoeConfig):
    """Qwen3-MoE's keys (num_experts 0: every layer dense) plus the hybrid ones."""

    model_type: str  # config.json's, reported as the model's
    shared_expert_intermediate_size: int  # the sigmoid-gated shared expert of MoE layers
    layer_types: list[str]  # per layer: RECURRENT (Gated DeltaNet) or ATTENTION
    linear: GatedDeltaNetShape  # the Gated DeltaNet layers' heads and conv

    @classmethod
    def hybrid(cls, raw: dict[str, Any], experts: dict[str, Any], model_type: str) -> Self:
        """Build from the language model's keys `raw` and the expert fields (see Qwen3MoeConfig.moe_keys)."""
        common = DecoderConfig.common(raw, max_positions=32768, eps=1e-6, default_head_dim=256, default_partial=0.25)
        return cls(
            **common,
            **experts,
            model_type=model_type,
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
            layer_types=hybrid_layer_types(raw, common["num_hidden_layers"]),
            linear=GatedDeltaNetShape.from_hf(raw),
        )

    def is_recurrent(self, layer: int) -> bool:
        return self.layer_types[layer] == RECURRENT

    def experts(self, parallel: ParallelContext) -> nn.Module:
        sizes = (self.moe_intermediate_size, self.routing(), parallel, self.shared_expert_intermediate_size)
        return SharedExpertGateMoE(self.hidden_size, *sizes)


class Qwen3NextConfig(HybridConfig):
    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Qwen3NextConfig":
        return cls.hybrid(raw, Qwen3MoeConfig.moe_keys(raw, default_norm_topk=True), "qwen3_next")


class HybridQwenForCausalLM(CausalLM):
    """Decoder layers whose mixer is Gated DeltaNet (`linear_attn`) or gated attention (`self_attn`), each
    followed by a dense MLP or the gated-shared-expert MoE; all norms zero-centred."""

    delta_net: type[GatedDeltaNet]  # the checkpoint's layout of the Gated DeltaNet input projections

    def __init__(
        self, cfg: HybridConfig, parallel: ParallelContext, dtype: torch.dtype, tensor_names: frozenset[str]
    ) -> None:
        super().__init__()
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
        layers = [self._layer(cfg, index, rotary, parallel) for index in range(cfg.num_hidden_layers)]
        self.model = DecoderStack(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps, norm=ZeroCentredRMSNorm)
        self.finish_init(cfg, cfg.model_type, dtype)

    def _layer(self, cfg: HybridConfig, index: int, rotary: RotaryEmbedding, parallel: ParallelContext) -> DecoderLayer:
        mixer: nn.Module
        if cfg.is_recurrent(index):
            mixer = self.delta_net(cfg.linear, cfg.hidden_size, cfg.rms_norm_eps, parallel)
        else:
            heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
            bias = cfg.attention_bias
            mixer = GatedSelfAttention(cfg.hidden_size, *heads, rotary, parallel, bias, bias, cfg.rms_norm_eps)
        name = "linear_attn" if cfg.is_recurrent(index) else "self_attn"
        return DecoderLayer(
            mixer, cfg.mlp(index, parallel), cfg.hidden_size, cfg.rms_norm_eps, ZeroCentredRMSNorm, name
        )

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        if name.startswith("mtp."):
            return None  # the multi-token-prediction layer: drafting with it is not supported for these models
        return super().checkpoint_target(name)


class Qwen3NextForCausalLM(HybridQwenForCausalLM):
    delta_net = GroupedProjectionDeltaNet

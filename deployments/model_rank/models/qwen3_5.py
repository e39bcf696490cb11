"""Qwen3.5, dense and MoE: `qwen3_5` / `qwen3_5_moe` are the language model of transformers'
Qwen3_5(Moe)ForConditionalGeneration (config.json's `text_config`, weights under `model.language_model.*`,
the vision tower's `model.visual.*` left unread); `qwen3_5_text` / `qwen3_5_moe_text` the text model saved
on its own (`model.*`). One file for both families: they share the hybrid stack of models/qwen3_next.py,
the Gated DeltaNet's split input projections and the weight names, and differ only in the MLP (MoE: every
layer routed, top-k always renormalised, with the gated shared expert).

Text only: every token's three mRoPE position streams are equal, which is plain RoPE at the token's
position over the rotary dims, so `rope_parameters.mrope_section` / `mrope_interleaved` are not read.
"""

from typing import Any

from deployments.model_rank.layers.gated_delta import SplitProjectionDeltaNet
from deployments.model_rank.models.base import require
from deployments.model_rank.models.qwen3_moe import Qwen3MoeConfig
from deployments.model_rank.models.qwen3_next import HybridConfig, HybridQwenForCausalLM
from deployments.model_rank.weights import WeightTarget

LANGUAGE_MODEL, VISION_TOWER = "model.language_model.", "model.visual."
OUTER_KEYS = ("dtype", "torch_dtype", "eos_token_id")  # taken from the top level where text_config lacks them


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The language model's keys: `text_config` of a multimodal config.json (tie_word_embeddings from the top
    level, where transformers reads it for the whole model), else the config itself."""
    nested = raw.get("text_config")
    if not isinstance(nested, dict):
        return raw
    text = dict(nested)
    for key in OUTER_KEYS:
        if text.get(key) is None and raw.get(key) is not None:
            text[key] = raw[key]
    text["tie_word_embeddings"] = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return text


class Qwen3_5Config(HybridConfig):
    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Qwen3_5Config":
        text = text_config(raw)
        dense = dict(
            intermediate_size=int(require(text, "intermediate_size")),
            moe_intermediate_size=0,
            num_experts=0,
            num_experts_per_tok=0,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        return cls.hybrid(text, dense, str(raw.get("model_type", "qwen3_5_text")))


class Qwen3_5MoeConfig(HybridConfig):
    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Qwen3_5MoeConfig":
        text = text_config(raw)
        every_layer_routed = dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        experts = Qwen3MoeConfig.moe_keys(text) | every_layer_routed
        return cls.hybrid(text, experts, str(raw.get("model_type", "qwen3_5_moe_text")))


class Qwen3_5ForCausalLM(HybridQwenForCausalLM):
    delta_net = SplitProjectionDeltaNet

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        if name.startswith(VISION_TOWER):
            return None  # images are not served yet
        if name.startswith(LANGUAGE_MODEL):
            name = "model." + name.removeprefix(LANGUAGE_MODEL)
        return super().checkpoint_target(name)

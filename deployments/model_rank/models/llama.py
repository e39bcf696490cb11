"""Llama (and Llama-shaped checkpoints such as Mistral-style GQA models without sliding windows)."""

from dataclasses import dataclass
from typing import Any

import torch

from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.layers.mlp import GatedMLP
from deployments.model_rank.layers.rotary import RotaryEmbedding
from deployments.model_rank.models.base import CausalLM, DecoderConfig, require


@dataclass
class LlamaConfig(DecoderConfig):
    intermediate_size: int
    mlp_bias: bool

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "LlamaConfig":
        return cls(
            **DecoderConfig.common(raw, max_positions=2048, eps=1e-6),
            intermediate_size=int(require(raw, "intermediate_size")),
            mlp_bias=bool(raw.get("mlp_bias", False)),
        )


class LlamaForCausalLM(CausalLM):
    def __init__(
        self, cfg: LlamaConfig, parallel: ParallelContext, dtype: torch.dtype, tensor_names: frozenset[str]
    ) -> None:
        super().__init__()
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
        layers = [
            cfg.layer(
                cfg.attention(rotary, parallel, o_bias=cfg.attention_bias, qk_norm=False),
                GatedMLP(cfg.hidden_size, cfg.intermediate_size, parallel, bias=cfg.mlp_bias),
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        self.stack(cfg, layers, "llama", dtype)

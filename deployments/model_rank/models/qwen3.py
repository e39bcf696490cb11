"""Qwen3 dense: Llama-shaped with per-head RMSNorm on q and k before RoPE."""

from dataclasses import dataclass
from typing import Any

import torch

from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.layers.attention import SelfAttention
from deployments.model_rank.layers.mlp import GatedMLP
from deployments.model_rank.layers.rotary import RotaryEmbedding
from deployments.model_rank.models.base import CausalLM, DecoderConfig, require


def reject_sliding_window(raw: dict[str, Any]) -> None:
    if raw.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported")


@dataclass
class Qwen3Config(DecoderConfig):
    intermediate_size: int

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Qwen3Config":
        reject_sliding_window(raw)
        return cls(
            **DecoderConfig.common(raw, max_positions=32768, eps=1e-6, default_head_dim=128),
            intermediate_size=int(require(raw, "intermediate_size")),
        )


def qwen3_attention(cfg: DecoderConfig, rotary: RotaryEmbedding, parallel: ParallelContext) -> SelfAttention:
    return cfg.attention(rotary, parallel, o_bias=cfg.attention_bias, qk_norm=True)


class Qwen3ForCausalLM(CausalLM):
    def __init__(
        self, cfg: Qwen3Config, parallel: ParallelContext, dtype: torch.dtype, tensor_names: frozenset[str]
    ) -> None:
        super().__init__()
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
        layers = [
            cfg.layer(
                qwen3_attention(cfg, rotary, parallel), GatedMLP(cfg.hidden_size, cfg.intermediate_size, parallel)
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        self.stack(cfg, layers, "qwen3", dtype)

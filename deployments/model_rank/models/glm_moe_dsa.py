"""GLM-5.3 (`glm_moe_dsa`): GLM-4.7-Flash's MLA (models/glm4_moe_lite.py) with DeepSeek sparse attention: a
per-token indexer on `full` layers whose selection the `shared` layers after it reuse
(layers/dsa_attention.py), routed experts after `first_k_dense_replace` dense layers."""

from dataclasses import dataclass
from typing import Any

import torch

from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.layers.decoder import DecoderLayer
from deployments.model_rank.layers.dsa_attention import IndexedMLAAttention
from deployments.model_rank.layers.dsa_index import SelectionRelay, TokenIndexer
from deployments.model_rank.layers.rotary import RotaryEmbedding, mla_softmax_scale
from deployments.model_rank.models.glm4_moe import GlmMtpCausalLM
from deployments.model_rank.models.glm4_moe_lite import Glm4MoeLiteConfig

INDEXER_KINDS = {"F": "full", "S": "shared"}


@dataclass(frozen=True)
class IndexerKeys:
    """The DSA indexer's config.json keys (defaults: transformers')."""

    heads: int  # index_n_heads
    head_dim: int  # index_head_dim
    topk: int  # index_topk
    types: tuple[str, ...]  # indexer_types: "full" (runs the indexer) or "shared" per layer

    @classmethod
    def from_hf(cls, raw: dict[str, Any], layers: int) -> "IndexerKeys":
        types = raw.get("indexer_types") or indexer_pattern(raw, layers)
        if len(types) != layers or set(types) - {"full", "shared"}:
            raise ValueError(f"indexer_types {types} does not give full/shared for each of {layers} layers")
        return cls(
            heads=int(raw.get("index_n_heads", 32)),
            head_dim=int(raw.get("index_head_dim", 128)),
            topk=int(raw.get("index_topk", 2048)),
            types=tuple(types),
        )

    def check_order(self, indexed: list[bool]) -> None:
        """A shared layer needs a full one before it (`indexed`: which layers are DSA attention)."""
        seen_full = False
        for index, (kind, is_dsa) in enumerate(zip(self.types, indexed)):
            if is_dsa and kind == "shared" and not seen_full:
                raise ValueError(f"indexer_types[{index}] is 'shared' but no 'full' indexer layer comes before it")
            seen_full |= is_dsa and kind == "full"


def indexer_pattern(raw: dict[str, Any], layers: int) -> list[str]:
    """transformers' schedule where config.json has no `indexer_types`: `index_topk_pattern` ("FSS..."), else
    every `index_topk_freq`-th layer from `index_skip_topk_offset` on runs the indexer."""
    pattern = raw.get("index_topk_pattern")
    if isinstance(pattern, str):
        if set(pattern) - set(INDEXER_KINDS):
            raise ValueError(f"index_topk_pattern {pattern!r} has letters other than F and S")
        return [INDEXER_KINDS[c] for c in pattern]
    if pattern is not None:
        return list(pattern)
    freq, offset = max(int(raw.get("index_topk_freq", 1)), 1), int(raw.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


@dataclass
class GlmMoeDsaConfig(Glm4MoeLiteConfig):
    indexer: IndexerKeys

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "GlmMoeDsaConfig":
        keys = cls.lite_keys(raw, first_dense=3, experts=(256, 8, 2.5))
        keys["rope_interleave"] = True  # the reference always pairs rope dims interleaved here
        indexer = IndexerKeys.from_hf(raw, keys["num_hidden_layers"])
        indexer.check_order([True] * keys["num_hidden_layers"])
        if keys["q_lora_rank"] is None:
            raise ValueError("config key 'q_lora_rank' is missing: the DSA indexer reads the q latent")
        return cls(**keys, indexer=indexer)


class GlmMoeDsaForCausalLM(GlmMtpCausalLM):
    def __init__(
        self, cfg: GlmMoeDsaConfig, parallel: ParallelContext, dtype: torch.dtype, tensor_names: frozenset[str]
    ) -> None:
        super().__init__()
        self.num_nextn_predict_layers = cfg.num_nextn_predict_layers
        rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope, cfg.max_position_embeddings, True)
        scale = mla_softmax_scale(cfg.rope, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        relay, idx = SelectionRelay(), cfg.indexer

        def layer(sparse: bool, index_kind: str, relay: SelectionRelay) -> DecoderLayer:
            indexer = None
            if index_kind == "full":
                indexer = TokenIndexer(cfg.hidden_size, cfg.q_lora_rank or 0, idx.heads, idx.head_dim, idx.topk, rotary)
            attention = IndexedMLAAttention(cfg.mla_dims(), rotary, scale, parallel, indexer, relay)
            return cfg.layer(attention, cfg.mlp(sparse, parallel))

        layers = [layer(kind == "sparse", ik, relay) for kind, ik in zip(cfg.mlp_layer_types, idx.types)]
        # The MTP layer drafts only with an indexer of its own (its steps select over its own cache).
        mtp_names = self.mtp_names(cfg, tensor_names)
        has_mtp = cfg.num_nextn_predict_layers > 0 and "self_attn.indexer.wk.weight" in mtp_names
        self.stack(cfg, layers, "glm_moe_dsa", dtype, has_mtp=has_mtp)
        if has_mtp:
            self.add_mtp(cfg, mtp_names, layer(True, "full", SelectionRelay()))

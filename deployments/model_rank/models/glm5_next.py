"""GLM-5.3-Flash (`glm5_next`): Kimi delta attention layers (layers/kda.py) beside NoPE MLA layers with a
k-pool DSA indexer (layers/dsa_attention.py), over four hyper-connection residual streams
(layers/hyper_connections.py), GLM routing with a shared expert, and a SwiGLU clamp on every MLP.

The checkpoint is transformers' Glm5NextForConditionalGeneration: config.json's `text_config`, the language
model under `model.language_model.*`, its vision tower `model.visual.*` (not read here), MTP layers after
the last decoder layer (not read: n-gram drafts serve it).
"""

import re
from dataclasses import dataclass
from typing import Any

import torch

from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.layers.dsa_attention import IndexedMLAAttention
from deployments.model_rank.layers.dsa_index import PoolIndexer, SelectionRelay
from deployments.model_rank.layers.hyper_connections import HyperConnectionKeys, HyperLayer, HyperStack
from deployments.model_rank.layers.kda import KdaShape, KimiDeltaAttention
from deployments.model_rank.layers.mla import MLADims
from deployments.model_rank.models.base import CausalLM, DecoderConfig, require, text_config
from deployments.model_rank.models.glm4_moe import GlmExpertsConfig, is_extra_mtp_layer
from deployments.model_rank.models.glm_moe_dsa import IndexerKeys
from deployments.model_rank.weights import WeightTarget

LANGUAGE_MODEL, VISION_TOWER = "model.language_model.", "model.visual."
LAYER_KINDS = ("linear_attention", "indexed_attention")
HC_NAME = re.compile(r"^(model\.layers\.\d+\.)hc_(attn|ffn)_(fn|base|scale)$")


def layer_kinds(raw: dict[str, Any], layers: int) -> list[str]:
    """`layer_types` (transformers' default: every fourth layer MLA, the rest KDA; "full_attention" is read
    as "indexed_attention"); any other entry is refused by name."""
    types = raw.get("layer_types") or ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    types = ["indexed_attention" if kind == "full_attention" else kind for kind in types]
    unknown = sorted(set(types) - set(LAYER_KINDS))
    if unknown or len(types) != layers:
        raise ValueError(
            f"layer_types {unknown or types} is not one of {', '.join(LAYER_KINDS)} for each of {layers} layers"
        )
    return types


@dataclass
class Glm5NextConfig(GlmExpertsConfig):
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    layer_types: list[str]
    mlp_layer_types: list[str]
    indexer: IndexerKeys
    index_kpool: int
    index_tail: bool  # index_kpool_always_select_tail
    kda: KdaShape
    hyper: HyperConnectionKeys
    swiglu_limit: float | None
    num_nextn_predict_layers: int

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Glm5NextConfig":
        text = text_config(raw)
        layers = int(require(text, "num_hidden_layers"))
        if int(text.get("qk_rope_head_dim", 0)):
            raise ValueError(f"qk_rope_head_dim is {text['qk_rope_head_dim']}: GLM-5.3-Flash's MLA has no rotary part")
        heads = int(require(text, "num_attention_heads"))
        if int(text.get("num_key_value_heads") or heads) != heads:
            raise ValueError("num_key_value_heads must equal num_attention_heads (MLA has one latent for all heads)")
        pool, topk = int(text.get("index_kpool", 16)), int(text.get("index_topk", 2048))
        if pool < 1 or topk % pool:
            raise ValueError(f"index_topk ({topk}) is not a multiple of index_kpool ({pool})")
        kinds = layer_kinds(text, layers)
        indexer = IndexerKeys.from_hf(text, layers)
        check_shared_follows_full(indexer.types, kinds)
        mlp_types = text.get("mlp_layer_types") or ["dense" if i < 3 else "sparse" for i in range(layers)]
        if len(mlp_types) != layers or set(mlp_types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types {mlp_types} does not give dense/sparse for each of {layers} layers")
        limit = text.get("swiglu_limit", 10.0)
        return cls(
            **DecoderConfig.common(text, max_positions=1048576, eps=1e-5, default_head_dim=1),
            **GlmExpertsConfig.expert_keys(text, experts=288, top_k=8, scaling=2.5),
            q_lora_rank=int(require(text, "q_lora_rank")),
            kv_lora_rank=int(require(text, "kv_lora_rank")),
            qk_nope_head_dim=int(require(text, "qk_nope_head_dim")),
            v_head_dim=int(require(text, "v_head_dim")),
            layer_types=kinds,
            mlp_layer_types=list(mlp_types),
            indexer=indexer,
            index_kpool=pool,
            index_tail=bool(text.get("index_kpool_always_select_tail", True)),
            kda=KdaShape.from_hf(text),
            hyper=HyperConnectionKeys(
                int(text.get("hc_mult", 4)), float(text.get("hc_eps", 1e-6)), int(text.get("hc_sinkhorn_iters", 20))
            ),
            swiglu_limit=None if limit is None else float(limit),
            num_nextn_predict_layers=int(text.get("num_nextn_predict_layers") or 1),
        )

    def mla_dims(self) -> MLADims:
        return MLADims(
            hidden_size=self.hidden_size,
            num_heads=self.num_attention_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=0,
            v_head_dim=self.v_head_dim,
            attention_bias=self.attention_bias,
            lora_eps=self.rms_norm_eps,
        )


def check_shared_follows_full(index_types: tuple[str, ...], kinds: list[str]) -> None:
    """A `shared` MLA layer reuses the selection of the layer right before it, which must be a `full` MLA
    layer (the reference hands a selection to the next layer only)."""
    for index, (kind, index_kind) in enumerate(zip(kinds, index_types)):
        if kind != "indexed_attention" or index_kind != "shared":
            continue
        before = index - 1
        if before < 0 or kinds[before] != "indexed_attention" or index_types[before] != "full":
            raise ValueError(f"indexer_types[{index}] is 'shared' but layer {before} is not a 'full' MLA layer")


class Glm5NextForCausalLM(CausalLM):
    def __init__(
        self, cfg: Glm5NextConfig, parallel: ParallelContext, dtype: torch.dtype, tensor_names: frozenset[str]
    ) -> None:
        super().__init__()
        self.num_nextn_predict_layers = cfg.num_nextn_predict_layers
        relay, idx = SelectionRelay(), cfg.indexer
        scale = (cfg.qk_nope_head_dim) ** -0.5
        layers = []
        for kind, index_kind, mlp_kind in zip(cfg.layer_types, idx.types, cfg.mlp_layer_types):
            if kind == "linear_attention":
                mixer = KimiDeltaAttention(cfg.kda, cfg.hidden_size, cfg.rms_norm_eps, parallel)
            else:
                indexer = None
                if index_kind == "full":
                    args = (cfg.hidden_size, cfg.q_lora_rank, idx.heads, idx.head_dim, idx.topk, cfg.index_kpool)
                    indexer = PoolIndexer(*args, tail=cfg.index_tail)
                mixer = IndexedMLAAttention(cfg.mla_dims(), None, scale, parallel, indexer, relay)
            mlp = cfg.mlp(mlp_kind == "sparse", parallel, cfg.swiglu_limit)
            layers.append(HyperLayer(mixer, mlp, cfg.hidden_size, cfg.rms_norm_eps, cfg.hyper))
        self.model = HyperStack(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps, cfg.hyper.streams)
        self.finish_init(cfg, "glm5_next", dtype)

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        if name.startswith(VISION_TOWER):
            return None  # the vision tower is not served yet
        if name.startswith(LANGUAGE_MODEL):
            name = "model." + name.removeprefix(LANGUAGE_MODEL)
        if is_extra_mtp_layer(name, self.config.num_hidden_layers, self.num_nextn_predict_layers):
            return None  # the MTP layers draft nothing here yet (n-gram drafts do)
        hc = HC_NAME.match(name)
        if hc:  # the hub's flat names for each block's hyper-connection weights
            return WeightTarget(f"{hc.group(1)}{hc.group(2)}_hc.{hc.group(3)}")
        return super().checkpoint_target(name)

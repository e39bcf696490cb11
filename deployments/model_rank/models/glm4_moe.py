"""GLM-4.5 / 4.6 / 4.7 (`glm4_moe`): partial RoPE, optional QK-norm, grouped sigmoid routing with shared
experts after `first_k_dense_replace` dense layers, and an optional multi-token-prediction (MTP) layer."""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deployments.model_rank.forward_batch import ForwardBatch, LayerCacheSpec, ParallelContext
from deployments.model_rank.layers.decoder import DecoderLayer
from deployments.model_rank.layers.embedding import LMHead, VocabEmbedding
from deployments.model_rank.layers.linear import ReplicatedLinear
from deployments.model_rank.layers.mlp import GatedMLP
from deployments.model_rank.layers.moe import RoutingConfig, SparseMoE
from deployments.model_rank.layers.norm import RMSNorm
from deployments.model_rank.layers.rotary import RotaryEmbedding
from deployments.model_rank.models.base import CausalLM, DecoderConfig, require
from deployments.model_rank.weights import WeightTarget, expert_target

MTP_OWN_PARTS = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


@dataclass
class GlmExpertsConfig(DecoderConfig):
    """The MLP keys GLM-4.5 to 4.7 and GLM-4.7-Flash (models/glm4_moe_lite.py) read alike: dense layers'
    `intermediate_size`; MoE layers' routed experts (grouped sigmoid routing) beside `n_shared_experts`."""

    intermediate_size: int
    moe_intermediate_size: int
    n_shared_experts: int
    routing: RoutingConfig

    @staticmethod
    def expert_keys(raw: dict[str, Any], experts: int, top_k: int, scaling: float) -> dict[str, Any]:
        """The fields above from config.json; `experts`, `top_k`, `scaling`: the family's transformers defaults."""
        return dict(
            intermediate_size=int(require(raw, "intermediate_size")),
            moe_intermediate_size=int(require(raw, "moe_intermediate_size")),
            n_shared_experts=int(raw.get("n_shared_experts", 1)),
            routing=RoutingConfig.grouped_sigmoid(raw, experts, top_k, scaling),
        )

    def mlp(self, sparse: bool, parallel: ParallelContext, limit: float | None = None) -> nn.Module:
        """A layer's MLP: the routed experts beside the shared ones, or the dense MLP (`limit`: a SwiGLU clamp)."""
        if not sparse:
            return GatedMLP(self.hidden_size, self.intermediate_size, parallel, limit=limit)
        shared = self.moe_intermediate_size * self.n_shared_experts
        return SparseMoE(self.hidden_size, self.moe_intermediate_size, self.routing, parallel, shared, limit)


@dataclass
class Glm4MoeConfig(GlmExpertsConfig):
    first_k_dense_replace: int
    use_qk_norm: bool
    num_nextn_predict_layers: int

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Glm4MoeConfig":
        return cls(
            **DecoderConfig.common(raw, max_positions=131072, eps=1e-5, default_partial=0.5),
            **GlmExpertsConfig.expert_keys(raw, experts=128, top_k=8, scaling=1.0),
            first_k_dense_replace=int(raw.get("first_k_dense_replace", 1)),
            use_qk_norm=bool(raw.get("use_qk_norm", False)),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 1)) or 0),
        )


def glm_layer(cfg: Glm4MoeConfig, index: int, rotary: RotaryEmbedding, parallel: ParallelContext) -> DecoderLayer:
    attention = cfg.attention(rotary, parallel, o_bias=False, qk_norm=cfg.use_qk_norm)
    return cfg.layer(attention, cfg.mlp(index >= cfg.first_k_dense_replace, parallel))


class SharedHead(nn.Module):
    def __init__(self, norm: RMSNorm, head: LMHead) -> None:
        super().__init__()
        self.norm = norm
        self.head = head


class Glm4MoeMTP(nn.Module):
    """The multi-token-prediction layer (checkpoint `model.layers.{num_hidden_layers}.*`), for drafts.

    It has its own KV cache (see `Glm4MoeForCausalLM.mtp_kv_cache_specs`); the main forward never calls it.
    """

    def __init__(self, cfg: Glm4MoeConfig, layer: DecoderLayer, embed: VocabEmbedding, head: LMHead) -> None:
        super().__init__()
        self.embed_tokens = embed
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * cfg.hidden_size, cfg.hidden_size)
        self.layer = layer
        self.shared_head = SharedHead(RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), head)

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Predict one token further: hidden [T, H] is the main `forward` output at each position,
        next_token_ids [T] the token that follows each position; `batch` has the layout of the main step that
        produced `hidden` (its positions, block tables and slots address the MTP cache; its input_ids are
        unused). Returns [T, H] after `shared_head.norm`; logits via `compute_logits`."""
        return self.shared_head.norm(self.residual(hidden, next_token_ids, batch))

    @torch.no_grad()
    def residual(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The layer's output before `shared_head.norm` [T, H]: what a chained draft feeds back as `hidden`."""
        embeds = self.enorm(self.embed_tokens(next_token_ids))  # [T, H]
        fused = self.eh_proj(torch.cat([embeds, self.hnorm(hidden)], dim=-1))  # [T, 2H] -> [T, H]
        return self.layer(fused, batch)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(hidden)  # [R, V] float32

    @torch.no_grad()
    def greedy_drafts(self, residual: torch.Tensor) -> torch.Tensor:
        """The likeliest next token of each row of `residual` [R, H] -> [R] int64."""
        return torch.argmax(self.compute_logits(self.shared_head.norm(residual)), dim=-1)


class GlmMtpCausalLM(CausalLM):
    """A GLM model whose checkpoint may hold an MTP layer after its decoder (`model.layers.{N}.*`: the layer,
    `enorm`, `hnorm`, `eh_proj`, `shared_head` and maybe copies of the embedding and head), loaded as
    `self.mtp` for drafts. Subclasses call `add_mtp` after building their stack."""

    def __init__(self) -> None:
        super().__init__()
        self.mtp: Glm4MoeMTP | None = None  # an instance attribute: a class default would hide the module
        self.mtp_prefix, self.num_nextn_predict_layers = "", 0

    @staticmethod
    def mtp_names(cfg: DecoderConfig, tensor_names: frozenset[str]) -> set[str]:
        """The checkpoint's MTP tensor names after the layer prefix (empty: no MTP layer stored)."""
        prefix = f"model.layers.{cfg.num_hidden_layers}."
        return {name[len(prefix) :] for name in tensor_names if name.startswith(prefix)}

    def add_mtp(self, cfg: "GlmExpertsConfig", mtp_names: set[str], layer: DecoderLayer) -> None:
        """Attach the MTP layer around `layer`, sharing the main embedding / head unless it stores copies."""
        self.mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
        embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size) if "embed_tokens.weight" in mtp_names else None
        head = LMHead(cfg.vocab_size, cfg.hidden_size) if "shared_head.head.weight" in mtp_names else None
        self.mtp = Glm4MoeMTP(cfg, layer, embed or self.model.embed_tokens, head or self.lm_head)

    def mtp_kv_cache_specs(self) -> list[LayerCacheSpec]:
        """The MTP layer's cache spec ([] without MTP); allocated and bound apart from the main caches."""
        return [self.mtp.layer.cache_spec()] if self.mtp is not None else []

    def bind_mtp_kv_caches(self, caches: list[tuple[torch.Tensor, ...]]) -> None:
        if self.mtp is None or len(caches) != 1:
            raise ValueError(f"got {len(caches)} MTP caches for {len(self.mtp_kv_cache_specs())} MTP layers")
        self.mtp.layer.bind_cache(caches[0])

    def after_load(self) -> None:
        """GLM checkpoints store copies of the embedding and head with the MTP layer: share equal ones."""
        if self.mtp is None:
            return
        if self.mtp.embed_tokens is not self.model.embed_tokens and torch.equal(
            self.mtp.embed_tokens.weight, self.model.embed_tokens.weight
        ):
            self.mtp.embed_tokens = self.model.embed_tokens
        head = self.mtp.shared_head.head
        if head is not self.lm_head and torch.equal(head.weight, self.lm_head.weight):
            self.mtp.shared_head.head = self.lm_head

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        if self.mtp is not None and name.startswith(self.mtp_prefix):
            rest = name[len(self.mtp_prefix) :]
            local = f"mtp.{rest}" if rest.startswith(MTP_OWN_PARTS) else f"mtp.layer.{rest}"
            return expert_target(local) or WeightTarget(local)
        if is_extra_mtp_layer(name, self.config.num_hidden_layers, self.num_nextn_predict_layers):
            return None  # MTP layers past the first (or one this model cannot draft with) are not read
        return super().checkpoint_target(name)


class Glm4MoeForCausalLM(GlmMtpCausalLM):
    def __init__(
        self, cfg: Glm4MoeConfig, parallel: ParallelContext, dtype: torch.dtype, tensor_names: frozenset[str]
    ) -> None:
        super().__init__()
        self.num_nextn_predict_layers = cfg.num_nextn_predict_layers
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
        layers = [glm_layer(cfg, i, rotary, parallel) for i in range(cfg.num_hidden_layers)]
        mtp_names = self.mtp_names(cfg, tensor_names)
        has_mtp = cfg.num_nextn_predict_layers > 0 and bool(mtp_names)
        self.stack(cfg, layers, "glm4_moe", dtype, has_mtp=has_mtp)
        if has_mtp:
            self.add_mtp(cfg, mtp_names, glm_layer(cfg, cfg.num_hidden_layers, rotary, parallel))


def is_extra_mtp_layer(name: str, num_hidden_layers: int, num_nextn: int) -> bool:
    """Whether `name` belongs to a layer past the decoder stack that config.json declares as MTP."""
    parts = name.split(".")
    if len(parts) < 3 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return False
    return num_hidden_layers <= int(parts[2]) < num_hidden_layers + num_nextn

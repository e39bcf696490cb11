"""GLM-4.5 / 4.6 / 4.7 (`glm4_moe`): partial RoPE, optional QK-norm, grouped sigmoid routing with shared
experts after `first_k_dense_replace` dense layers, and an optional multi-token-prediction (MTP) layer."""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deployments.model_rank.forward_batch import ForwardBatch, LayerCacheSpec, ParallelContext
from deployments.model_rank.layers.attention import SelfAttention
from deployments.model_rank.layers.decoder import DecoderLayer, DecoderStack
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
class Glm4MoeConfig(DecoderConfig):
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    first_k_dense_replace: int
    use_qk_norm: bool
    num_nextn_predict_layers: int

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Glm4MoeConfig":
        return cls(
            **DecoderConfig.common(raw, max_positions=131072, eps=1e-5, default_partial=0.5),
            intermediate_size=int(require(raw, "intermediate_size")),
            moe_intermediate_size=int(require(raw, "moe_intermediate_size")),
            n_routed_experts=int(require(raw, "n_routed_experts", "num_local_experts")),
            num_experts_per_tok=int(require(raw, "num_experts_per_tok")),
            n_shared_experts=int(raw.get("n_shared_experts", 1)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            first_k_dense_replace=int(raw.get("first_k_dense_replace", 1)),
            use_qk_norm=bool(raw.get("use_qk_norm", False)),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 1)) or 0),
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


def glm_layer(cfg: Glm4MoeConfig, index: int, rotary: RotaryEmbedding, parallel: ParallelContext) -> DecoderLayer:
    attn = SelfAttention(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        rotary,
        parallel,
        qkv_bias=cfg.attention_bias,
        o_bias=False,
        qk_norm_eps=cfg.rms_norm_eps if cfg.use_qk_norm else None,
    )
    mlp: nn.Module
    if index >= cfg.first_k_dense_replace:
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        mlp = SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.routing(), parallel, shared)
    else:
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, parallel)
    return DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps)


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


class Glm4MoeForCausalLM(CausalLM):
    def __init__(
        self, cfg: Glm4MoeConfig, parallel: ParallelContext, dtype: torch.dtype, tensor_names: frozenset[str]
    ) -> None:
        super().__init__()
        self.mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
        self.num_nextn_predict_layers = cfg.num_nextn_predict_layers
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
        layers = [glm_layer(cfg, i, rotary, parallel) for i in range(cfg.num_hidden_layers)]
        self.model = DecoderStack(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps)
        mtp_names = {n[len(self.mtp_prefix) :] for n in tensor_names if n.startswith(self.mtp_prefix)}
        has_mtp = cfg.num_nextn_predict_layers > 0 and bool(mtp_names)
        self.finish_init(cfg, "glm4_moe", dtype, has_mtp=has_mtp)
        self.mtp: Glm4MoeMTP | None = None
        if has_mtp:
            # The MTP layer shares the main embedding / head unless the checkpoint stores its own copies.
            embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size) if "embed_tokens.weight" in mtp_names else None
            head = LMHead(cfg.vocab_size, cfg.hidden_size) if "shared_head.head.weight" in mtp_names else None
            layer = glm_layer(cfg, cfg.num_hidden_layers, rotary, parallel)
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
            return None  # MTP layers past the first are not used for drafts
        return super().checkpoint_target(name)


def is_extra_mtp_layer(name: str, num_hidden_layers: int, num_nextn: int) -> bool:
    """Whether `name` belongs to a layer past the decoder stack that config.json declares as MTP."""
    parts = name.split(".")
    if len(parts) < 3 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return False
    return num_hidden_layers <= int(parts[2]) < num_hidden_layers + num_nextn

"""Nemotron-H (`nemotron_h`): a schedule of blocks, each h + mixer(norm(h)), the mixer one of Mamba2 ("M"),
attention without position encoding ("*"), a relu^2 MLP ("-") or a latent relu^2 MoE ("E"); and optional
multi-token-prediction layers (models/nemotron_h_mtp.py).

Checkpoints name the stack `backbone.*` (transformers' own saves may say `model.*`), its embedding
`embeddings` and its final norm `norm_f`; both map onto the shared DecoderStack's names.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deployments.model_rank.forward_batch import ForwardBatch, LayerCacheSpec, ParallelContext
from deployments.model_rank.layers.attention import SelfAttention
from deployments.model_rank.layers.decoder import DecoderStack
from deployments.model_rank.layers.latent_moe import LatentMoE
from deployments.model_rank.layers.mamba2 import Mamba2Mixer, Mamba2Shape
from deployments.model_rank.layers.mlp import ReluSquaredMLP
from deployments.model_rank.layers.moe import RoutingConfig
from deployments.model_rank.layers.norm import WideScaleRMSNorm
from deployments.model_rank.models.base import CausalLM, DecoderConfig, require
from deployments.model_rank.models.nemotron_h_mtp import MTP_PREFIX, NemotronHMTP
from deployments.model_rank.weights import WeightTarget

# config.json spells the schedule as a pattern string (hub) or a list of names (transformers 5).
PATTERN_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
LISTED_KINDS = {
    "linear_attention": "mamba",
    "mamba": "mamba",
    "full_attention": "attention",
    "attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}
TOKEN_MIXERS = ("mamba", "attention")  # the kinds whose mixer reads the step's batch
HUB_NAMES = (  # checkpoint prefix -> this model's, first match wins
    ("backbone.embeddings.", "model.embed_tokens."),
    ("model.embeddings.", "model.embed_tokens."),
    ("backbone.norm_f.", "model.norm."),
    ("model.norm_f.", "model.norm."),
    ("backbone.", "model."),
)


def block_schedule(raw: dict[str, Any], list_key: str, pattern_key: str, default: list[str] | None) -> list[str]:
    """The block kinds ("mamba", "attention", "mlp", "moe") from `list_key`, else `pattern_key`, else `default`."""
    if raw.get(list_key) is not None:
        names, known = list(raw[list_key]), LISTED_KINDS
    elif raw.get(pattern_key) is not None:
        names, known = list(raw[pattern_key]), PATTERN_KINDS
    elif default is not None:
        names, known = default, LISTED_KINDS
    else:
        raise ValueError(f"config key {list_key!r} (or {pattern_key!r}) is missing")
    unknown = sorted({str(name) for name in names if name not in known})
    if unknown or not names:
        raise ValueError(f"{list_key}: unknown or no block types {unknown} (expected {', '.join(known)})")
    return [known[name] for name in names]


def _first(raw: dict[str, Any], *keys: str, default: Any) -> Any:
    """The first of `keys` present (current spelling, then the legacy `mamba_*` one)."""
    return next((raw[key] for key in keys if raw.get(key) is not None), default)


def _limit(value: Any) -> float:
    """One end of time_step_limit: a number, "Infinity", or transformers' {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def mamba_shape(raw: dict[str, Any], hidden_size: int, eps: float) -> Mamba2Shape:
    """The Mamba2 layers' sizes, with transformers' NemotronHConfig defaults."""
    if _first(raw, "mamba_hidden_act", default="silu") != "silu":
        raise ValueError(f"mamba_hidden_act {raw['mamba_hidden_act']!r} is not supported (silu)")
    # dt's clamp is the config's time_step_limit ((0, inf): none), as transformers' one-token decode runs it;
    # its chunked prefill clamps at time_step_min instead, which only differs where softplus falls below it.
    low, high = _first(raw, "time_step_limit", "mamba_dt_limit", default=(0.0, float("inf")))
    shape = Mamba2Shape(
        hidden_size=hidden_size,
        num_heads=int(_first(raw, "mamba_num_heads", default=128)),
        head_dim=int(_first(raw, "mamba_head_dim", default=64)),
        state_size=int(_first(raw, "ssm_state_size", default=128)),
        n_groups=int(_first(raw, "n_groups", "mamba_n_groups", default=8)),
        conv_kernel=int(_first(raw, "conv_kernel", "mamba_d_conv", default=4)),
        use_conv_bias=bool(_first(raw, "use_conv_bias", "mamba_conv_bias", default=True)),
        use_bias=bool(_first(raw, "use_bias", default=False)),
        norm_eps=eps,
        time_step_limit=(_limit(low), _limit(high)),
    )
    if shape.num_heads % shape.n_groups:
        raise ValueError(f"mamba_num_heads ({shape.num_heads}) is not a multiple of n_groups ({shape.n_groups})")
    return shape


@dataclass
class NemotronHConfig(DecoderConfig):
    block_types: list[str]  # per layer: "mamba", "attention", "mlp" or "moe"
    mtp_block_types: list[str]  # the blocks of one MTP step (default attention then MoE)
    num_nextn_predict_layers: int  # MTP steps the checkpoint declares (only the first drafts)
    intermediate_size: int  # the MLP blocks'
    mlp_bias: bool  # MLP, shared-expert and latent projections
    mamba: Mamba2Shape
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None  # experts run in this smaller space between two projections; None: hidden size
    routing: RoutingConfig

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "NemotronHConfig":
        blocks = block_schedule(raw, "layers_block_type", "hybrid_override_pattern", None)
        if _first(raw, "mlp_hidden_act", default="relu2") != "relu2":
            raise ValueError(f"mlp_hidden_act {raw['mlp_hidden_act']!r} is not supported (relu2)")
        eps = float(_first(raw, "layer_norm_epsilon", default=1e-5))
        # num_hidden_layers is the schedule's length (transformers' saves drop the key); every norm reads
        # layer_norm_epsilon (an rms_norm_eps key is not Nemotron-H's).
        fixed = dict(raw, num_hidden_layers=len(blocks), rms_norm_eps=eps)
        common = DecoderConfig.common(fixed, max_positions=4096, eps=eps, default_head_dim=128, gated_silu=False)
        return cls(
            **common,
            block_types=blocks,
            mtp_block_types=block_schedule(
                raw, "mtp_layers_block_type", "mtp_hybrid_override_pattern", ["attention", "moe"]
            ),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
            intermediate_size=int(require(raw, "intermediate_size")),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            mamba=mamba_shape(raw, common["hidden_size"], eps),
            moe_intermediate_size=int(_first(raw, "moe_intermediate_size", default=7688)),
            moe_shared_expert_intermediate_size=int(_first(raw, "moe_shared_expert_intermediate_size", default=7688)),
            moe_latent_size=int(raw["moe_latent_size"]) if raw.get("moe_latent_size") else None,
            routing=RoutingConfig.grouped_sigmoid(raw, experts=8, top_k=2, scaling=1.0),
        )


class NemotronHBlock(nn.Module):
    """One entry of the schedule: h + mixer(norm(h)). `mixer` is the block's only sublayer, also where it
    mixes no tokens (MLP, MoE), so attention blocks are told apart by `kind`, not by the mixer's type."""

    def __init__(self, kind: str, mixer: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.kind = kind
        self.norm = WideScaleRMSNorm(hidden_size, eps)
        self.mixer = mixer

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        normed = self.norm(hidden)  # [T, H]
        mixed = self.mixer(normed, batch) if self.kind in TOKEN_MIXERS else self.mixer(normed)
        return hidden + mixed  # [T, H]

    def cache_spec(self) -> LayerCacheSpec:
        return self.mixer.cache_spec()

    def bind_cache(self, cache: tuple[torch.Tensor, ...]) -> None:
        self.mixer.bind_cache(cache)


def nemotron_block(cfg: NemotronHConfig, kind: str, parallel: ParallelContext) -> NemotronHBlock:
    mixer: nn.Module
    if kind == "mamba":
        mixer = Mamba2Mixer(cfg.mamba, parallel)
    elif kind == "attention":
        # No RoPE and no biases (transformers' NemotronHAttention ignores attention_bias).
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        mixer = SelfAttention(cfg.hidden_size, heads, kv_heads, cfg.head_dim, None, parallel)
    elif kind == "mlp":
        mixer = ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size, parallel, bias=cfg.mlp_bias)
    else:
        mixer = LatentMoE(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.moe_shared_expert_intermediate_size,
            cfg.moe_latent_size,
            cfg.routing,
            parallel,
            bias=cfg.mlp_bias,
        )
    return NemotronHBlock(kind, mixer, cfg.hidden_size, cfg.rms_norm_eps)


class NemotronHForCausalLM(CausalLM):
    def __init__(
        self, cfg: NemotronHConfig, parallel: ParallelContext, dtype: torch.dtype, tensor_names: frozenset[str]
    ) -> None:
        super().__init__()
        layers = [nemotron_block(cfg, kind, parallel) for kind in cfg.block_types]
        self.model = DecoderStack(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps)  # type: ignore[arg-type]
        # The shared stack with its final norm (`norm_f`) in Nemotron-H's convention, like every block's.
        self.model.norm = WideScaleRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.finish_init(cfg, "nemotron_h", dtype)
        self.mtp: NemotronHMTP | None = None
        if cfg.num_nextn_predict_layers > 0 and any(name.startswith(MTP_PREFIX) for name in tensor_names):
            blocks = [nemotron_block(cfg, kind, parallel) for kind in cfg.mtp_block_types]
            self.mtp = NemotronHMTP(cfg.hidden_size, cfg.rms_norm_eps, blocks, self.model.embed_tokens, self.lm_head)
            self.config.has_mtp = self.mtp.drafts

    def _attention_layers(self) -> list[nn.Module]:
        # MLP and MoE blocks hold neither a KV cache nor a state slot: select attention blocks by kind.
        return [layer for layer in self.model.layers if layer.kind == "attention"]

    def mtp_kv_cache_specs(self) -> list[LayerCacheSpec]:
        """The MTP step's attention caches ([] where it cannot draft); allocated apart from the trunk's."""
        return self.mtp.cache_specs() if self.mtp is not None and self.config.has_mtp else []

    def bind_mtp_kv_caches(self, caches: list[tuple[torch.Tensor, ...]]) -> None:
        if self.mtp is None or not self.config.has_mtp:
            raise ValueError("this checkpoint has no MTP layer that drafts")
        self.mtp.bind_caches(caches)

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        if name.startswith(MTP_PREFIX):
            return self.mtp.checkpoint_target(name) if self.mtp is not None else None
        for hub, ours in HUB_NAMES:
            if name.startswith(hub):
                name = ours + name[len(hub) :]
                break
        return super().checkpoint_target(name)

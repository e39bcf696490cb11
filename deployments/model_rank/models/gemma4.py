"""Gemma 4's language model (`gemma4_text`, and the text model of a `gemma4` image-text checkpoint: its
`text_config`, weights under `model.language_model.*`, the towers' left unread): sliding-window and full
attention layers over `layer_types`.

- Attention: q/k norms, an unscaled norm on v, attention scale 1; sliding layers see their last
  `sliding_window` positions with default RoPE, full layers everything with "proportional" partial RoPE
  and their own head size and kv heads (`per_layer_config`, or `global_head_dim` /
  `num_global_key_value_heads`); with `attention_k_eq_v` a full layer's V is its raw K projection.
- The last `num_kv_shared_layers` layers compute no K/V: each reads the cache of the last earlier layer of
  its kind, with no copy (and, with `use_double_wide_mlp`, has an MLP twice as wide).
- Sandwich norms, a per-layer output scalar, per-layer input embeddings, GELU-tanh MLPs, an embedding
  scaled by sqrt(hidden), and `final_logit_softcapping` on the logits (layers/sandwich.py).
- With `enable_moe_block`, every layer's MLP has an expert block beside it (`num_experts`, `top_k_experts`,
  `moe_intermediate_size`; layers/moe.py's ScaledSoftmaxRouter and GELU-tanh Experts).
Refused at startup, naming the key: bidirectional attention, other activations or RoPE types;
`--vision` on a `gemma4` checkpoint (its tower is not served yet).
"""

from dataclasses import dataclass
from typing import Any, Self

import torch
from torch import nn

from deployments.model_rank.forward_batch import ForwardBatch, LayerCacheSpec, ParallelContext
from deployments.model_rank.layers.attention import PagedAttention, kv_head_sharding
from deployments.model_rank.layers.linear import ColumnParallelLinear, RowParallelLinear
from deployments.model_rank.layers.norm import NativeWideRMSNorm, unscaled_rms_norm
from deployments.model_rank.layers.parallel import divide
from deployments.model_rank.layers.rotary import RopeConfig, RotaryEmbedding
from deployments.model_rank.layers.sandwich import (
    GeluTanhMLP,
    PerLayerInputs,
    SandwichLayer,
    SandwichMoELayer,
    SandwichStack,
)
from deployments.model_rank.models.base import CausalLM, DecoderConfig, require, text_config
from deployments.model_rank.weights import WeightTarget
from kernels.activation import tanh

SLIDING, FULL = "sliding_attention", "full_attention"
ACTIVATIONS = ("gelu_pytorch_tanh",)
PER_LAYER_NAMES = (
    "model.embed_tokens_per_layer.",
    "model.per_layer_model_projection.",
    "model.per_layer_projection_norm.",
)
SHARED_SKIPPED = ("k_proj", "v_proj", "k_norm", "v_norm")  # a kv-shared layer's own K/V weights go unused
# transformers' RoPE of each layer kind where config.json gives none.
DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
LANGUAGE_MODEL = "model.language_model."  # a `gemma4` checkpoint's text model
TOWERS = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


@dataclass(frozen=True)
class LayerShape:
    """One layer's attention: its kind, head size, kv heads, and the layer whose K/V it reads (None: its own)."""

    kind: str
    head_dim: int
    kv_heads: int
    shares: int | None = None


@dataclass(frozen=True)
class KindRope:
    """A layer kind's RoPE: base, and the share of each head's pairs that turn ("proportional" RoPE)."""

    theta: float
    proportion: float = 1.0


def _layer_types(raw: dict[str, Any], layers: int) -> list[str]:
    kinds = list(raw.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(layers)])
    if len(kinds) != layers or any(kind not in (SLIDING, FULL) for kind in kinds):
        raise ValueError(f"layer_types must list {layers} of {SLIDING!r} or {FULL!r}")
    kinds[-1] = FULL  # transformers forces it so
    return kinds


def _layer_shapes(raw: dict[str, Any], kinds: list[str], head_dim: int, kv_heads: int) -> list[LayerShape]:
    per_layer = {int(k): v for k, v in (raw.get("per_layer_config") or {}).items()}
    if not per_layer:  # the keys transformers folds into per_layer_config when it builds the config
        full: dict[str, Any] = {"head_dim": raw.get("global_head_dim", 512)}
        if raw.get("attention_k_eq_v") and raw.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = raw["num_global_key_value_heads"]
        per_layer = {i: full for i, kind in enumerate(kinds) if kind == FULL}
    shapes = []
    for i, kind in enumerate(kinds):
        own = per_layer.get(i, {})
        shapes.append(
            LayerShape(kind, int(own.get("head_dim", head_dim)), int(own.get("num_key_value_heads", kv_heads)))
        )
    shared = int(raw.get("num_kv_shared_layers") or 0)
    first = len(kinds) - shared
    for i in range(first, len(kinds)):
        producers = [j for j in range(first) if kinds[j] == kinds[i]]
        if not producers:
            raise ValueError(f"num_kv_shared_layers: layer {i} ({kinds[i]}) has no earlier layer of its kind to share")
        source = shapes[producers[-1]]
        shapes[i] = LayerShape(kinds[i], source.head_dim, source.kv_heads, producers[-1])
    return shapes


def _experts(raw: dict[str, Any]) -> tuple[int, int, int]:
    count, top_k = int(require(raw, "num_experts")), int(require(raw, "top_k_experts"))
    if not 0 < top_k <= count:
        raise ValueError(f"top_k_experts ({top_k}) must be between 1 and num_experts ({count})")
    return count, top_k, int(require(raw, "moe_intermediate_size"))


def _kind_rope(raw: dict[str, Any], kind: str) -> KindRope:
    params = (raw.get("rope_parameters") or DEFAULT_ROPE).get(kind) or DEFAULT_ROPE[kind]
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "proportional") or params.get("factor", 1.0) != 1.0:
        raise ValueError(
            f"rope_parameters.{kind}: rope type {rope_type!r} with factor {params.get('factor')} is not supported"
        )
    theta = float(params.get("rope_theta", DEFAULT_ROPE[kind]["rope_theta"]))
    return KindRope(theta, float(params.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0)


@dataclass
class Gemma4Config(DecoderConfig):
    intermediate_size: int
    sliding_window: int
    shapes: list[LayerShape]
    ropes: dict[str, KindRope]
    k_eq_v: bool
    per_layer: int  # hidden_size_per_layer_input (0: no per-layer inputs)
    per_layer_vocab: int
    softcap: float | None
    double_wide: bool
    experts: tuple[int, int, int] | None = None  # (count, per token, intermediate size) with the expert block
    model_type: str = "gemma4_text"

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> Self:
        model_type = str(raw.get("model_type", "gemma4_text"))
        raw = text_config(raw, tied_default=True)
        if raw.get("use_bidirectional_attention") == "all":
            raise ValueError("use_bidirectional_attention 'all' (non-causal text) is not supported")
        if raw.get("hidden_activation", ACTIVATIONS[0]) not in ACTIVATIONS:
            raise ValueError(f"hidden_activation {raw['hidden_activation']!r} is not supported ({ACTIVATIONS[0]} only)")
        common = DecoderConfig.common(raw, max_positions=131_072, eps=1e-6, default_head_dim=256, gated_silu=False)
        kinds = _layer_types(raw, common["num_hidden_layers"])
        window = int(raw.get("sliding_window") or 512)
        if window < 1:
            raise ValueError(f"sliding_window must be at least 1, not {window}")
        common["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", True))
        return cls(
            **common,
            intermediate_size=int(require(raw, "intermediate_size")),
            sliding_window=window,
            shapes=_layer_shapes(raw, kinds, common["head_dim"], common["num_key_value_heads"]),
            ropes={kind: _kind_rope(raw, kind) for kind in (SLIDING, FULL)},
            k_eq_v=bool(raw.get("attention_k_eq_v", False)),
            per_layer=int(raw.get("hidden_size_per_layer_input") or 0),
            per_layer_vocab=int(raw.get("vocab_size_per_layer_input") or common["vocab_size"]),
            softcap=float(raw["final_logit_softcapping"]) if raw.get("final_logit_softcapping") else None,
            double_wide=bool(raw.get("use_double_wide_mlp", False)),
            experts=_experts(raw) if raw.get("enable_moe_block") else None,
            model_type=model_type,
        )


def kind_rotary(rope: KindRope, head_dim: int, max_positions: int) -> RotaryEmbedding:
    """RoPE over the whole head where the first `proportion` of the pairs turn and the rest stand still, with
    exponents over the whole head size (transformers' "proportional" RoPE; proportion 1 is the default)."""
    rotary = RotaryEmbedding(head_dim, RopeConfig(theta=rope.theta), max_positions)
    turning = int(rope.proportion * head_dim // 2)
    rotary.inv_freq[turning:] = 0.0  # a zero frequency turns by nothing: cos 1, sin 0
    return rotary


class Gemma4Attention(nn.Module):
    """One layer's attention; a kv-shared layer projects only q and reads its source layer's cache."""

    def __init__(
        self, cfg: Gemma4Config, shape: LayerShape, rotary: RotaryEmbedding, parallel: ParallelContext
    ) -> None:
        super().__init__()
        hidden, heads, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
        self.head_dim, self.eps, self.shares = shape.head_dim, cfg.rms_norm_eps, shape.shares
        self.local_heads = divide(heads, parallel.tp_size, "attention heads")
        self.local_kv_heads, kv_index, kv_shards = kv_head_sharding(shape.kv_heads, parallel)
        self.q_proj = ColumnParallelLinear(hidden, heads * self.head_dim, parallel, bias)
        self.q_norm = NativeWideRMSNorm(self.head_dim, cfg.rms_norm_eps)
        if shape.shares is None:
            kv_out = shape.kv_heads * self.head_dim
            self.k_proj = ColumnParallelLinear(hidden, kv_out, parallel, bias, kv_index, kv_shards)
            k_is_v = cfg.k_eq_v and shape.kind == FULL
            self.v_proj = None if k_is_v else ColumnParallelLinear(hidden, kv_out, parallel, bias, kv_index, kv_shards)
            self.k_norm = NativeWideRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, parallel, bias=bias)
        self.rotary = rotary
        window = cfg.sliding_window if shape.kind == SLIDING else 0
        self.attn = PagedAttention(self.local_heads, self.local_kv_heads, self.head_dim, 1.0, window=window)
        self.source: list[PagedAttention] = []  # a kv-shared layer's source (a list: not a submodule of this one)

    def cache_spec(self) -> LayerCacheSpec:
        return self.attn.spec

    def bind_cache(self, cache: tuple[torch.Tensor, ...]) -> None:
        self.attn.bind_cache(cache)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        tokens = hidden.shape[0]
        q = self.q_norm(self.q_proj(hidden).view(tokens, self.local_heads, self.head_dim))  # [T, Hq, D]
        if self.source:
            q, _ = self.rotary(batch.positions, q, q[:, :1].clone())  # only q turns: the source's keys did
            out = self.source[0].attend(q, batch)
        else:
            k = self.k_proj(hidden).view(tokens, self.local_kv_heads, self.head_dim)  # [T, Hkv, D]
            v = k if self.v_proj is None else self.v_proj(hidden).view(tokens, self.local_kv_heads, self.head_dim)
            q, k = self.rotary(batch.positions, q, self.k_norm(k))
            out = self.attn(q, k, unscaled_rms_norm(v, self.eps), batch)  # [T, Hq, D]
        return self.o_proj(out.reshape(tokens, self.local_heads * self.head_dim))  # [T, H]


class Gemma4ForCausalLM(CausalLM):
    def __init__(
        self, cfg: Gemma4Config, parallel: ParallelContext, dtype: torch.dtype, tensor_names: frozenset[str]
    ) -> None:
        super().__init__()
        rotaries: dict[tuple[str, int], RotaryEmbedding] = {}
        layers = []
        for shape in cfg.shapes:
            key = (shape.kind, shape.head_dim)
            if key not in rotaries:
                rotaries[key] = kind_rotary(cfg.ropes[shape.kind], shape.head_dim, cfg.max_position_embeddings)
            width = cfg.intermediate_size * (2 if cfg.double_wide and shape.shares is not None else 1)
            attention = Gemma4Attention(cfg, shape, rotaries[key], parallel)
            mlp = GeluTanhMLP(cfg.hidden_size, width, parallel)
            shape_args = (attention, mlp, cfg.hidden_size, cfg.rms_norm_eps, cfg.per_layer)
            if cfg.experts is None:
                layers.append(SandwichLayer(*shape_args))
            else:
                layers.append(SandwichMoELayer(*shape_args, cfg.experts, parallel))
        for layer, shape in zip(layers, cfg.shapes):
            if shape.shares is not None:
                layer.self_attn.source.append(layers[shape.shares].self_attn.attn)
        self.model = SandwichStack(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps)
        if cfg.per_layer:
            self.model.per_layer_inputs = PerLayerInputs(
                cfg.per_layer_vocab, cfg.hidden_size, cfg.num_hidden_layers, cfg.per_layer, cfg.rms_norm_eps
            )
        self.softcap = cfg.softcap
        self.finish_init(cfg, cfg.model_type, dtype)

    def _attention_layers(self) -> list[nn.Module]:
        return [layer for layer in self.model.layers if layer.self_attn.shares is None]  # the others own no cache

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # [R, V] float32
        return logits if self.softcap is None else tanh(logits / self.softcap) * self.softcap

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        if name.startswith(TOWERS):
            return None  # the image and audio towers: not served yet
        if name.startswith(LANGUAGE_MODEL):
            name = "model." + name.removeprefix(LANGUAGE_MODEL)
        if name.startswith(PER_LAYER_NAMES):  # the stack's per-layer inputs live in one module here
            return WeightTarget(name.replace("model.", "model.per_layer_inputs.", 1))
        parts = name.split(".")
        if (
            len(parts) > 4
            and parts[:2] == ["model", "layers"]
            and parts[3] == "self_attn"
            and parts[4] in SHARED_SKIPPED
        ):
            layer = self.model.layers[int(parts[2])]
            if layer.self_attn.shares is not None or (parts[4] == "v_proj" and layer.self_attn.v_proj is None):
                return None
        return super().checkpoint_target(name)

"""What every model exposes to the runner (`CausalLM`), its summary (`ModelInfo`) and shared config keys."""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deployments.model_rank.forward_batch import ForwardBatch, LayerCacheSpec, LayerStateSpec, ParallelContext
from deployments.model_rank.layers.attention import SelfAttention
from deployments.model_rank.layers.decoder import DecoderLayer, DecoderStack
from deployments.model_rank.layers.embedding import LMHead
from deployments.model_rank.layers.recurrent import RecurrentMixer
from deployments.model_rank.layers.rotary import RopeConfig, RotaryEmbedding
from deployments.model_rank.weights import WeightTarget, expert_target


@dataclass
class ModelInfo:
    """The facts about a loaded model the runner and scheduler need."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    dtype: torch.dtype  # the weights' and KV cache's dtype
    eos_token_ids: list[int]  # config.json's end tokens, plus generation_config.json's
    has_mtp: bool = False  # a multi-token-prediction layer is loaded as `model.mtp`
    # A vision tower is loaded (models with one, when the engine's `vision` setting is on): the placeholder
    # id its images expand to, and its spatial merge (patches per placeholder side).
    vision: bool = False
    image_token_id: int | None = None
    spatial_merge_size: int = 0


SILU_NAMES = ("silu", "swish")  # transformers' ACT2FN names for one activation


def require(raw: dict[str, Any], key: str, *aliases: str) -> Any:
    """A key that must be present; `aliases` are other spellings (hub vs transformers-5 saves)."""
    for name in (key, *aliases):
        if raw.get(name) is not None:
            return raw[name]
    raise ValueError(f"config key {key!r} is missing")


def id_list(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]


OUTER_KEYS = ("dtype", "torch_dtype", "eos_token_id")  # taken from the top level where text_config lacks them


def text_config(raw: dict[str, Any], tied_default: bool = False) -> dict[str, Any]:
    """The language model's keys: `text_config` of a multimodal config.json (tie_word_embeddings from the top
    level, where transformers reads it for the whole model), else the config itself."""
    nested = raw.get("text_config")
    if not isinstance(nested, dict):
        return raw
    text = dict(nested)
    for key in OUTER_KEYS:
        if text.get(key) is None and raw.get(key) is not None:
            text[key] = raw[key]
    text["tie_word_embeddings"] = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", tied_default))
    return text


@dataclass
class DecoderConfig:
    """Keys every supported architecture reads from config.json."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    rope: RopeConfig
    eos_token_id: list[int]
    dtype: str | None  # the checkpoint's declared dtype (`dtype`, or legacy `torch_dtype`)

    @staticmethod
    def common(
        raw: dict[str, Any],
        *,
        max_positions: int,
        eps: float,
        default_head_dim: int | None = None,
        default_partial: float = 1.0,
        gated_silu: bool = True,
    ) -> dict[str, Any]:
        """The shared fields as keyword arguments, with the architecture's transformers defaults.
        `gated_silu`: the MLPs are SiLU-gated whatever `hidden_act` says, so any other activation is refused."""
        if gated_silu and raw.get("hidden_act", "silu") not in SILU_NAMES:
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported (silu only)")
        hidden, heads = int(require(raw, "hidden_size")), int(require(raw, "num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if kv_heads < 1 or heads % kv_heads:  # else every attention step fails on its query groups
            raise ValueError(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})")
        head_dim = raw.get("head_dim") or default_head_dim or hidden // heads
        return dict(
            vocab_size=int(require(raw, "vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=int(require(raw, "num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            max_position_embeddings=int(raw.get("max_position_embeddings") or max_positions),
            rms_norm_eps=float(raw.get("rms_norm_eps", eps)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            rope=RopeConfig.from_hf(raw, default_partial=default_partial),
            eos_token_id=id_list(raw.get("eos_token_id")),
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )

    def attention(
        self, rotary: RotaryEmbedding, parallel: ParallelContext, o_bias: bool, qk_norm: bool
    ) -> SelfAttention:
        """GQA self-attention over these heads, q/k/v biased by `attention_bias`; `qk_norm`: per-head RMSNorm
        of q and k at `rms_norm_eps` (Qwen3, GLM's `use_qk_norm`)."""
        heads = (self.num_attention_heads, self.num_key_value_heads, self.head_dim)
        eps = self.rms_norm_eps if qk_norm else None
        return SelfAttention(self.hidden_size, *heads, rotary, parallel, self.attention_bias, o_bias, eps)

    def layer(self, mixer: nn.Module, mlp: nn.Module) -> DecoderLayer:
        """A pre-norm decoder layer with RMSNorms."""
        return DecoderLayer(mixer, mlp, self.hidden_size, self.rms_norm_eps)


class CausalLM(nn.Module):
    """A decoder-only language model over a paged KV cache (the runner's whole view of the model).

    Subclasses build `self.model` (a DecoderStack named like the checkpoint's `model.*`) and call
    `finish_init`, or both at once with `stack`. `forward` returns final-norm hidden states [T, H];
    `compute_logits` projects rows.
    """

    config: ModelInfo
    model: DecoderStack
    lm_head: LMHead
    packed_weights: int = 0  # projection tensors packed for the CPU matmul kernel (set by load_model)
    weights_format: str = ""  # what the weights are: a dtype, or a GGUF's block types (set by load_model)

    def stack(
        self, cfg: DecoderConfig, layers: list[DecoderLayer], model_type: str, dtype: torch.dtype, has_mtp: bool = False
    ) -> None:
        """`self.model` over `layers` with a final RMSNorm, then `finish_init`."""
        self.model = DecoderStack(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps)
        self.finish_init(cfg, model_type, dtype, has_mtp)

    def finish_init(self, cfg: DecoderConfig, model_type: str, dtype: torch.dtype, has_mtp: bool = False) -> None:
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied_to=tied)
        self.config = ModelInfo(
            model_type=model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.num_hidden_layers,
            max_position_embeddings=cfg.max_position_embeddings,
            dtype=dtype,
            eos_token_ids=list(cfg.eos_token_id),
            has_mtp=has_mtp,
        )

    def kv_cache_specs(self) -> list[LayerCacheSpec]:
        """One spec per attention layer, sized for this tensor-parallel rank."""
        return [layer.cache_spec() for layer in self._attention_layers()]

    def state_specs(self) -> list[LayerStateSpec]:
        """One spec per recurrent layer ([]: an attention-only model keeps no per-sequence state)."""
        return [mixer.state_spec() for mixer in self._recurrent_mixers()]

    def bind_state_pools(self, pools: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Hand each recurrent layer its (conv, recurrent) slot pools, as allocated from `state_specs()`."""
        mixers = self._recurrent_mixers()
        if len(pools) != len(mixers):
            raise ValueError(f"got {len(pools)} state pools for {len(mixers)} recurrent layers")
        for mixer, pool in zip(mixers, pools):
            mixer.bind_state(pool)

    def _attention_layers(self) -> list[nn.Module]:
        return [layer for layer in self.model.layers if not isinstance(layer.mixer, RecurrentMixer)]

    def _recurrent_mixers(self) -> list[RecurrentMixer]:
        return [layer.mixer for layer in self.model.layers if isinstance(layer.mixer, RecurrentMixer)]

    def mtp_kv_cache_specs(self) -> list[LayerCacheSpec]:
        """The MTP layer's cache specs ([]: the model has no MTP layer to draft with)."""
        return []

    def bind_kv_caches(self, caches: list[tuple[torch.Tensor, ...]]) -> None:
        """Hand each attention layer its cache tensors (as allocated from `kv_cache_specs()`)."""
        layers = self._attention_layers()
        if len(caches) != len(layers):
            raise ValueError(f"got {len(caches)} layer caches for {len(layers)} attention layers")
        for layer, cache in zip(layers, caches):
            layer.bind_cache(cache)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)  # [T, H]

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [R, V] float32

    def encode_image(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's embeddings [placeholders, H] from its patches (models that load a vision tower)."""
        raise ValueError(f"{self.config.model_type} has no vision tower loaded")

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def after_load(self) -> None:
        """Hook run once all weights are in (e.g. to drop duplicated tensors)."""

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        """Map a checkpoint tensor name to a parameter (None: a tensor this model deliberately skips)."""
        if name.endswith("rotary_emb.inv_freq"):
            return None  # old exports saved the rotary buffer; it is recomputed
        if name == "lm_head.weight" and self.lm_head.tied:
            return None  # tied to the embedding
        return expert_target(name) or WeightTarget(name)

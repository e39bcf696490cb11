"""Rotary position embedding: full or partial, rotate-half or interleaved pairs, with scaled variants.

`RopeConfig.from_hf` reads both the transformers-5 `rope_parameters` dict and the legacy hub keys
(`rope_theta`, `rope_scaling`, `partial_rotary_factor`), with the same precedence transformers uses.
"""

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernels import dispatch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    factor: float | None = None  # linear / llama3 / yarn
    original_max_position_embeddings: int | None = None  # llama3 / yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn (also rescales MLA's softmax scale)
    attention_factor: float | None = None  # yarn
    truncate: bool = True  # yarn
    # Multimodal RoPE (Qwen3.5): rotary pair counts per position axis (temporal, row, column), which pick
    # the interleaved pairs that turn with each axis (`mrope_axes`); None: one position per token.
    mrope_section: tuple[int, int, int] | None = None

    @classmethod
    def from_hf(cls, raw: dict[str, Any], default_partial: float = 1.0, default_theta: float = 10000.0) -> "RopeConfig":
        """Read a config.json dict; values inside the rope dict win over top-level legacy keys."""
        params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        original = raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", default_partial))
        return cls(
            rope_type=rope_type,
            theta=float(params.get("rope_theta", raw.get("rope_theta", default_theta))),
            partial_rotary_factor=float(partial),
            factor=params.get("factor"),
            original_max_position_embeddings=original or raw.get("max_position_embeddings"),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
            mrope_section=mrope_section(params.get("mrope_section")),
        )


def mrope_section(value: Any) -> tuple[int, int, int] | None:
    """`rope_parameters.mrope_section`: three pair counts (temporal, row, column), or None where absent."""
    if value is None:
        return None
    if not isinstance(value, list | tuple) or len(value) != 3 or not all(_count(n) for n in value):
        raise ValueError(
            f"rope_parameters.mrope_section must list three pair counts (temporal, row, column): {value!r}"
        )
    return (int(value[0]), int(value[1]), int(value[2]))


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(rope: RopeConfig, qk_head_dim: int) -> float:
    """MLA's attention scale: yarn checkpoints with `mscale_all_dim` sharpen it by mscale^2."""
    scale = qk_head_dim**-0.5
    if rope.rope_type != "default" and rope.mscale_all_dim and rope.factor:
        scale *= _yarn_mscale(float(rope.factor), float(rope.mscale_all_dim)) ** 2
    return scale


def inverse_frequencies(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies [dim/2] (float32) and the factor applied to cos/sin."""
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (rope.theta**exponent)  # [dim/2]
    if rope.rope_type == "linear":
        return inv_freq / float(rope.factor or 1.0), 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, inv_freq), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim, max_positions)
    return inv_freq, 1.0


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, a smooth blend between the two cut-offs."""
    factor = float(rope.factor or 1.0)
    old_len = float(rope.original_max_position_embeddings or 8192)
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp between; cos/sin scaled by mscale."""
    original = float(rope.original_max_position_embeddings or max_positions)
    factor = float(rope.factor) if rope.factor is not None else max_positions / original
    if rope.attention_factor is not None:
        attention = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention = _yarn_mscale(factor, float(rope.mscale)) / _yarn_mscale(factor, float(rope.mscale_all_dim))
    else:
        attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention


def mrope_axes(section: tuple[int, int, int], pairs: int) -> torch.Tensor:
    """The position axis (0 temporal, 1 row, 2 column) of each of `pairs` rotary pairs, interleaved as
    transformers' Qwen3.5 rotary lays them out whatever `mrope_interleaved` says: pair j takes the row if
    j % 3 == 1 and j < 3 * section[1], the column if j % 3 == 2 and j < 3 * section[2], else the temporal
    axis. Sections need not sum to `pairs`: pairs past them turn with the temporal position, as there."""
    axes = torch.zeros(pairs, dtype=torch.long)
    for axis in (1, 2):
        axes[axis : 3 * section[axis] : 3] = axis
    return axes


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q/k laid out [T, heads, head_dim] at the batch's token positions; with the rope
    config's `mrope_section`, at each row's three multimodal positions where a step has them."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int, interleaved: bool = False) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * rope.partial_rotary_factor)
        self.interleaved = interleaved
        inv_freq, self.attention_scaling = inverse_frequencies(rope, self.rotary_dim, max_positions)
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)
        axes = None if rope.mrope_section is None else mrope_axes(rope.mrope_section, self.rotary_dim // 2)
        self.mrope_axes: torch.Tensor | None
        self.register_buffer("mrope_axes", axes, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, mrope_positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`mrope_positions` [3, T]: a step covering image placeholders (needs `mrope_section`)."""
        if mrope_positions is not None:
            if self.mrope_axes is None:  # only Qwen3.5 reads images, and its config always has sections
                raise RuntimeError("a step with image positions reached a rotary without mrope sections")
            args = (self.mrope_axes, q, k, self.inv_freq, self.attention_scaling)
            return dispatch.apply_mrope(positions, mrope_positions, *args)
        return dispatch.apply_rotary(positions, q, k, self.inv_freq, self.attention_scaling, self.interleaved)

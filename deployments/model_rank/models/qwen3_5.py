"""Qwen3.5, dense and MoE (`qwen3_5`, `qwen3_5_moe` and their `_text` checkpoints): the hybrid stack of
models/qwen3_next.py with split Gated DeltaNet projections, mRoPE, and a vision tower beside it.

`qwen3_5` / `qwen3_5_moe` are the language model of transformers'
Qwen3_5(Moe)ForConditionalGeneration (config.json's `text_config`, weights under `model.language_model.*`,
the vision tower `model.visual.*` read only with vision on: models/qwen3_5_vision.py); `qwen3_5_text` /
`qwen3_5_moe_text` the text model saved
on its own (`model.*`). One file for both families: they share the hybrid stack of models/qwen3_next.py,
the Gated DeltaNet's split input projections and the weight names, and differ only in the MLP (MoE: every
layer routed, top-k always renormalised, with the gated shared expert).

For text, every token's three mRoPE positions are equal, which is plain RoPE at the token's position
(shifted past any image before it); a step over image placeholders rotates by the rows' three positions,
the pairs interleaved by `rope_parameters.mrope_section` (layers/rotary.py, step_rows.py).
"""

from dataclasses import dataclass, replace
from typing import Any, Self

import torch

from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.layers.gated_delta import SplitProjectionDeltaNet
from deployments.model_rank.models.base import require, text_config
from deployments.model_rank.models.qwen3_5_vision import VisionConfig, VisionTower
from deployments.model_rank.models.qwen3_moe import Qwen3MoeConfig
from deployments.model_rank.models.qwen3_next import HybridConfig, HybridQwenForCausalLM
from deployments.model_rank.weights import WeightTarget

LANGUAGE_MODEL, VISION_TOWER = "model.language_model.", "model.visual."
MROPE_SECTION = (11, 11, 10)  # transformers' Qwen3.5 rotary where rope_parameters has no mrope_section


def vision_keys(raw: dict[str, Any]) -> tuple[VisionConfig | None, int | None]:
    """A multimodal config.json's tower and image placeholder id (None, None: a text checkpoint)."""
    vision = raw.get("vision_config")
    if not isinstance(vision, dict) or raw.get("image_token_id") is None:
        return None, None
    return VisionConfig.from_hf(vision), int(raw["image_token_id"])


@dataclass
class Qwen3_5Config(HybridConfig):
    # The checkpoint's vision tower and placeholder id (None: a text checkpoint, or vision is off: load_model).
    vision: VisionConfig | None = None
    image_token_id: int | None = None

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Qwen3_5Config":
        text = text_config(raw)
        dense = dict(
            intermediate_size=int(require(text, "intermediate_size")),
            moe_intermediate_size=0,
            num_experts=0,
            num_experts_per_tok=0,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        return cls.hybrid(text, dense, str(raw.get("model_type", "qwen3_5_text"))).multimodal(raw)

    def multimodal(self, raw: dict[str, Any]) -> Self:
        """The image side: the rotary's sections (config.json's, else transformers' default; any sum, see
        layers/rotary.py's mrope_axes), so an image never meets a rotary without them; the vision tower."""
        self.rope = replace(self.rope, mrope_section=self.rope.mrope_section or MROPE_SECTION)
        self.vision, self.image_token_id = vision_keys(raw)
        return self


class Qwen3_5MoeConfig(Qwen3_5Config):
    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Qwen3_5MoeConfig":
        text = text_config(raw)
        every_layer_routed = dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        experts = Qwen3MoeConfig.moe_keys(text) | every_layer_routed
        return cls.hybrid(text, experts, str(raw.get("model_type", "qwen3_5_moe_text"))).multimodal(raw)


class Qwen3_5ForCausalLM(HybridQwenForCausalLM):
    delta_net = SplitProjectionDeltaNet

    def __init__(
        self, cfg: Qwen3_5Config, parallel: ParallelContext, dtype: torch.dtype, tensor_names: frozenset[str]
    ) -> None:
        super().__init__(cfg, parallel, dtype, tensor_names)
        self.visual: VisionTower | None = None
        if cfg.vision is not None:
            self.visual = VisionTower(cfg.vision)  # replicated on every rank
            self.config.vision, self.config.image_token_id = True, cfg.image_token_id
            self.config.spatial_merge_size = cfg.vision.spatial_merge_size

    def encode_image(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        if self.visual is None:
            return super().encode_image(patches, grid)
        return self.visual(patches, grid)  # [t * h * w / merge^2, H]

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        if name.startswith(VISION_TOWER):
            return None if self.visual is None else WeightTarget("visual." + name.removeprefix(VISION_TOWER))
        if name.startswith(LANGUAGE_MODEL):
            name = "model." + name.removeprefix(LANGUAGE_MODEL)
        return super().checkpoint_target(name)

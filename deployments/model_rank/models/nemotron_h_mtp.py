"""Nemotron-H's multi-token-prediction step (checkpoint `mtp.layers.{i}.*`), for drafts.

One step is a short schedule of blocks (config `mtp_layers_block_type`, by default attention then MoE): its
first layer fuses the token's embedding with the trunk's hidden state (`enorm`, `hnorm`, `eh_proj`), its
last ends with `final_layernorm`, whose output both gives the logits (the trunk's lm_head) and is fed back
as the hidden state of a chained draft. The step has its own KV cache, apart from the trunk's; a step with
a Mamba2 block would need state slots of its own, so such a step is loaded but never drafts.
"""

import torch
from torch import nn

from deployments.model_rank.forward_batch import ForwardBatch, LayerCacheSpec
from deployments.model_rank.layers.embedding import LMHead, VocabEmbedding
from deployments.model_rank.layers.linear import ReplicatedLinear
from deployments.model_rank.layers.norm import WideScaleRMSNorm
from deployments.model_rank.weights import WeightTarget, expert_target

MTP_PREFIX = "mtp.layers."
FUSION_PARTS = ("enorm.", "hnorm.", "eh_proj.")  # stored with the step's first layer
END_PARTS = ("final_layernorm.",)  # stored with its last


class NemotronHMTP(nn.Module):
    """eh_proj(enorm(embed(next token)) ++ hnorm(hidden)) -> the step's blocks -> final_layernorm."""

    def __init__(
        self, hidden_size: int, eps: float, blocks: list[nn.Module], embed: VocabEmbedding, head: LMHead
    ) -> None:
        super().__init__()
        self.embed_tokens = embed  # the trunk's (the hub checkpoints store no copy)
        self.enorm = WideScaleRMSNorm(hidden_size, eps)
        self.hnorm = WideScaleRMSNorm(hidden_size, eps)
        self.eh_proj = ReplicatedLinear(2 * hidden_size, hidden_size)
        self.layers = nn.ModuleList(blocks)
        self.final_layernorm = WideScaleRMSNorm(hidden_size, eps)
        self.lm_head = head  # the trunk's

    @property
    def drafts(self) -> bool:
        """Whether the step can draft: attention, MLP and MoE blocks only (no recurrent state)."""
        return all(block.kind != "mamba" for block in self.layers)

    def attention_blocks(self) -> list[nn.Module]:
        return [block for block in self.layers if block.kind == "attention"]

    def cache_specs(self) -> list[LayerCacheSpec]:
        return [block.cache_spec() for block in self.attention_blocks()]

    def bind_caches(self, caches: list[tuple[torch.Tensor, ...]]) -> None:
        blocks = self.attention_blocks()
        if len(caches) != len(blocks):
            raise ValueError(f"got {len(caches)} MTP caches for {len(blocks)} MTP attention layers")
        for block, cache in zip(blocks, caches):
            block.bind_cache(cache)

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Predict one token further: hidden [T, H] is the trunk's `forward` output at each position,
        next_token_ids [T] the token that follows each position; `batch` has the layout of the step that
        produced `hidden` (its positions, block tables and slots address the MTP cache; its input_ids are
        unused). Returns [T, H] after `final_layernorm`; logits via `compute_logits`."""
        return self.residual(hidden, next_token_ids, batch)

    @torch.no_grad()
    def residual(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """What a chained draft feeds back as `hidden`: here the normed output itself [T, H]."""
        embeds = self.enorm(self.embed_tokens(next_token_ids))  # [T, H]
        fused = self.eh_proj(torch.cat([embeds, self.hnorm(hidden)], dim=-1))  # [T, 2H] -> [T, H]
        for block in self.layers:
            fused = block(fused, batch)
        return self.final_layernorm(fused)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [R, V] float32

    @torch.no_grad()
    def greedy_drafts(self, residual: torch.Tensor) -> torch.Tensor:
        """The likeliest next token of each row of `residual` [R, H] -> [R] int64."""
        return torch.argmax(self.compute_logits(residual), dim=-1)

    def checkpoint_target(self, name: str) -> WeightTarget | None:
        """Map `mtp.layers.{i}.*` onto this module (`mtp.*`); layers past the first step are skipped."""
        index, _, rest = name[len(MTP_PREFIX) :].partition(".")
        if not index.isdigit():
            return WeightTarget(name)  # not a layout this module knows: reported as unexpected
        layer, last = int(index), len(self.layers) - 1
        if layer > last:
            return None  # a later MTP step: drafts chain the first one
        if (layer == 0 and rest.startswith(FUSION_PARTS)) or (layer == last and rest.startswith(END_PARTS)):
            return WeightTarget(f"mtp.{rest}")
        local = f"mtp.layers.{layer}.{rest}"
        return expert_target(local) or WeightTarget(local)

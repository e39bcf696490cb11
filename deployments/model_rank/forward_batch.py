"""The contract between the runner and the model code: one step's tensors and the KV cache layout.

The runner builds a `ForwardBatch` from the scheduler's step plan (deployments/model_rank/device_batch.py);
model files read it only through their attention layers. Sequences are laid out one after another in the
flat token dimension T.
"""

from dataclasses import dataclass, field

import torch

from kernels.paged_meta import PagedMeta
from kernels.recurrent_scan import ScanRows
from kernels.scan_meta import ScanMeta


@dataclass
class ForwardBatch:
    """One forward pass over S sequences holding T new tokens in all (built by the runner)."""

    input_ids: torch.Tensor  # [T] int64: the new tokens, sequence after sequence
    # [T] int64: each new token's rotary position in its own sequence (its index, moved by the shift of
    # the images before it: step_rows.py)
    positions: torch.Tensor
    query_lens: list[int]  # [S]: new tokens per sequence (sums to T)
    context_lens: list[int]  # [S]: tokens of each sequence in the cache after this step (cached + new)
    block_tables: list[list[int]]  # [S][n]: the cache blocks holding each sequence, in order
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    logits_indices: torch.Tensor  # [R] int64: rows of the flat hidden states whose logits are wanted
    block_size: int  # tokens per cache block
    # Hybrid models (recurrent layers beside attention): each sequence's state slot, whose states cover the
    # tokens before this step and are advanced in place; empty for attention-only models.
    state_slots: list[int] = field(default_factory=list)  # [S]
    # [S]: (row offset within the sequence's new tokens, slot): the states after that row are copied there
    # (a prefix-cache snapshot at a block boundary, or a verify round's per-position states).
    state_captures: list[list[tuple[int, int]]] = field(default_factory=list)
    # Steps covering image placeholders only (None otherwise): [3, T] int64 each row's (temporal, row,
    # column) rotary positions; the flat rows [N] int64 whose input embeddings are the images' [N, H].
    mrope_positions: torch.Tensor | None = None
    image_rows: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    # The kernels' device metadata, built before the layers so that no layer copies to the device: the
    # attention layout per row limit (kernels/paged_meta.py) and a hybrid step's recurrent rows
    # (kernels/scan_meta.py). Empty in batches made by hand: attention then builds its own once per step.
    paged: dict[int, PagedMeta] = field(default_factory=dict)
    scan_rows: ScanRows | None = None
    scan: ScanMeta | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


@dataclass(frozen=True)
class LayerCacheSpec:
    """What one attention layer keeps per token (declared by the model, allocated by the runner)."""

    kind: str  # "kv": separate K and V per kv head; "latent": one compressed MLA row per token
    num_kv_heads: int = 0  # "kv": kv heads held by this rank
    head_dim: int = 0  # "kv": per-head size of K (and of V unless v_head_dim is set)
    v_head_dim: int = 0  # "kv": per-head size of V; 0 = head_dim
    latent_dim: int = 0  # "latent": kv_lora_rank + qk_rope_head_dim (+ index_dim)
    index_dim: int = 0  # "latent": of latent_dim, a DSA indexer's columns per token (layers/dsa_attention.py)

    def elements_per_token(self) -> int:
        if self.kind == "latent":
            return self.latent_dim
        return self.num_kv_heads * (self.head_dim + (self.v_head_dim or self.head_dim))

    def allocate(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, ...]:
        """The cache tensors: (k, v) of [blocks, block_size, kv_heads, dim], or (latent,).

        Uninitialised: attention reads only slots a step has written, and untouched pages cost nothing.
        """
        if self.kind == "latent":
            return (torch.empty(num_blocks, block_size, self.latent_dim, dtype=dtype, device=device),)
        k = torch.empty(num_blocks, block_size, self.num_kv_heads, self.head_dim, dtype=dtype, device=device)
        v = torch.empty(
            num_blocks, block_size, self.num_kv_heads, self.v_head_dim or self.head_dim, dtype=dtype, device=device
        )
        return (k, v)


@dataclass(frozen=True)
class LayerStateSpec:
    """What one recurrent layer (Gated DeltaNet, Mamba2) keeps per sequence, in a state slot: the causal
    conv's last inputs and the recurrent state (declared by the model, allocated by the runner).

    A slot's states are a pure function of the tokens they cover, so copying a slot is restoring a prefix.
    """

    conv_shape: tuple[int, ...]  # (kernel - 1, channels): the inputs the next tokens' conv still reads
    recurrent_shape: tuple[int, ...]  # e.g. (heads, key_dim, value_dim): kept in float32

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        conv = torch.Size(self.conv_shape).numel() * torch.empty((), dtype=dtype).element_size()
        return conv + torch.Size(self.recurrent_shape).numel() * 4

    def allocate(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [slots, kernel - 1, channels] in the model's dtype, recurrent [slots, ...] float32), zeroed."""
        conv = torch.zeros(num_slots, *self.conv_shape, dtype=dtype, device=device)
        return conv, torch.zeros(num_slots, *self.recurrent_shape, dtype=torch.float32, device=device)


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in its tensor-parallel group (set by the rank at startup)."""

    tp_rank: int = 0
    tp_size: int = 1

    @property
    def is_parallel(self) -> bool:
        return self.tp_size > 1

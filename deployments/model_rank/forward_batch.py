"""The contract between the runner and the model code: one step's tensors and the KV cache layout.

The runner builds a `ForwardBatch` from the scheduler's step plan; model files read it only through their
attention layers. Sequences are laid out one after another in the flat token dimension T.
"""

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """One forward pass over S sequences holding T new tokens in all (built by the runner)."""

    input_ids: torch.Tensor  # [T] int64: the new tokens, sequence after sequence
    positions: torch.Tensor  # [T] int64: each new token's position in its own sequence
    query_lens: list[int]  # [S]: new tokens per sequence (sums to T)
    context_lens: list[int]  # [S]: tokens of each sequence in the cache after this step (cached + new)
    block_tables: list[list[int]]  # [S][n]: the cache blocks holding each sequence, in order
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    logits_indices: torch.Tensor  # [R] int64: rows of the flat hidden states whose logits are wanted
    block_size: int  # tokens per cache block

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
    latent_dim: int = 0  # "latent": kv_lora_rank + qk_rope_head_dim

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
class ParallelContext:
    """This rank's place in its tensor-parallel group (set by the rank at startup)."""

    tp_rank: int = 0
    tp_size: int = 1

    @property
    def is_parallel(self) -> bool:
        return self.tp_size > 1

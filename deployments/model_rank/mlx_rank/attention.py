"""Paged attention over MLX arrays, and the attention blocks and decoder built on it.

A layer's cache is a list of arrays of [blocks * block_size, ...] (slots flat): new rows are scattered to
their slots, and each sequence attends over the rows its block table names, on its own, in float32.
"""

from collections.abc import Callable

import mlx.core as mx

from deployments.model_rank.mlx_rank.batch import MlxBatch
from deployments.model_rank.mlx_rank.layers import Linear, RMSNorm, Rotary


class PagedCache:
    """One layer's cache arrays (allocated by the runner; updated in place by the layer's writes)."""

    def __init__(self) -> None:
        self.arrays: list[mx.array] = []  # kv: [K, V]; latent: [latent]

    def write(self, index: int, values: mx.array, slots: mx.array) -> None:
        self.arrays[index][slots] = values.astype(self.arrays[index].dtype)

    def context(self, index: int, slots: mx.array) -> mx.array:
        return self.arrays[index][slots]  # [context, ...]


def causal_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """One sequence's new queries over its whole context, in float32.

    q [L, Hq, D], k [C, Hkv, D], v [C, Hkv, Dv] -> [L, Hq, Dv]; query j sits at position C - L + j.
    """
    num_q, num_heads = q.shape[0], q.shape[1]
    num_k, group = k.shape[0], num_heads // k.shape[1]
    qh = q.astype(mx.float32).transpose(1, 0, 2)  # [Hq, L, D]
    kh = mx.repeat(k.astype(mx.float32), group, axis=1).transpose(1, 0, 2)  # [Hq, C, D]
    vh = mx.repeat(v.astype(mx.float32), group, axis=1).transpose(1, 0, 2)  # [Hq, C, Dv]
    scores = (qh @ kh.transpose(0, 2, 1)) * scale  # [Hq, L, C]
    if num_q > 1:
        future = mx.arange(num_k)[None, :] > (mx.arange(num_q)[:, None] + (num_k - num_q))  # [L, C]
        scores = mx.where(future, -mx.inf, scores)
    probs = mx.softmax(scores, axis=-1)
    return (probs @ vh).transpose(1, 0, 2).astype(q.dtype)  # [L, Hq, Dv]


class SelfAttention:
    """GQA: q/k/v projections, optional per-head QK-norm before RoPE (`rotary` None: no position encoding,
    as in Nemotron-H), paged attention, o_proj."""

    def __init__(
        self,
        q: Linear,
        k: Linear,
        v: Linear,
        o: Linear,
        q_norm: RMSNorm | None,
        k_norm: RMSNorm | None,
        rotary: Rotary | None,
        heads: int,
        kv_heads: int,
        head_dim: int,
        scale: float,
    ) -> None:
        self.q, self.k, self.v, self.o = q, k, v, o
        self.q_norm, self.k_norm = q_norm, k_norm
        self.rotary = rotary
        self.heads, self.kv_heads, self.head_dim, self.scale = heads, kv_heads, head_dim, scale
        self.cache = PagedCache()

    def __call__(self, hidden: mx.array, batch: MlxBatch) -> mx.array:
        tokens = hidden.shape[0]
        q = self.q(hidden).reshape(tokens, self.heads, self.head_dim)  # [T, Hq, D]
        k = self.k(hidden).reshape(tokens, self.kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v(hidden).reshape(tokens, self.kv_heads, self.head_dim)  # [T, Hkv, D]
        out = self.attend(q, k, v, batch)  # [T, Hq, D]
        return self.o(out.reshape(tokens, self.heads * self.head_dim))  # [T, H]

    def attend(self, q: mx.array, k: mx.array, v: mx.array, batch: MlxBatch) -> mx.array:
        """QK-norm and RoPE (where the layer has them), the cache write, then each sequence over its context:
        q [T, Hq, D], k / v [T, Hkv, D] -> [T, Hq, D]."""
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(batch, q, k)
        self.cache.write(0, k, batch.slots)
        self.cache.write(1, v, batch.slots)
        parts = []
        for (start, end), slots in zip(batch.spans, batch.context_slots):
            if end > start:
                keys, values = self.cache.context(0, slots), self.cache.context(1, slots)
                parts.append(causal_attention(q[start:end], keys.astype(q.dtype), values.astype(q.dtype), self.scale))
        return mx.concatenate(parts, axis=0)  # [T, Hq, D]


class MLAAttention:
    """Multi-head latent attention: one cached row per token (normalised KV latent, then the rope key)."""

    def __init__(
        self,
        q_proj: Linear | None,
        q_a: Linear | None,
        q_a_norm: RMSNorm | None,
        q_b: Linear | None,
        kv_a: Linear,
        kv_a_norm: RMSNorm,
        kv_b: Linear,
        o: Linear,
        rotary: Rotary,
        heads: int,
        nope: int,
        rope: int,
        v_dim: int,
        kv_lora_rank: int,
        scale: float,
    ) -> None:
        self.q_proj, self.q_a, self.q_a_norm, self.q_b = q_proj, q_a, q_a_norm, q_b
        self.kv_a, self.kv_a_norm, self.kv_b, self.o = kv_a, kv_a_norm, kv_b, o
        self.rotary = rotary
        self.heads, self.nope, self.rope, self.v_dim, self.lora, self.scale = (
            heads,
            nope,
            rope,
            v_dim,
            kv_lora_rank,
            scale,
        )
        self.cache = PagedCache()

    def _queries(self, hidden: mx.array) -> mx.array:
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            assert self.q_a is not None and self.q_a_norm is not None and self.q_b is not None
            q = self.q_b(self.q_a_norm(self.q_a(hidden)))
        return q.reshape(hidden.shape[0], self.heads, self.nope + self.rope)  # [T, H, nope + rope]

    def __call__(self, hidden: mx.array, batch: MlxBatch) -> mx.array:
        tokens = hidden.shape[0]
        q = self._queries(hidden)
        q_nope, q_rot = q[..., : self.nope], q[..., self.nope :]
        latent = self.kv_a(hidden)  # [T, lora + rope]
        kv_nope, k_rot = latent[:, : self.lora], latent[:, self.lora :]
        q_rot, k_rot = self.rotary(batch, q_rot, k_rot[:, None, :])  # [T, H, rope], [T, 1, rope]
        self.cache.write(0, mx.concatenate([self.kv_a_norm(kv_nope), k_rot[:, 0]], axis=-1), batch.slots)
        q = mx.concatenate([q_nope, q_rot], axis=-1)  # [T, H, nope + rope]
        parts = []
        for (start, end), slots in zip(batch.spans, batch.context_slots):
            if end > start:
                rows = self.cache.context(0, slots)  # [C, lora + rope]
                length = rows.shape[0]
                kv = self.kv_b(rows[:, : self.lora]).reshape(length, self.heads, self.nope + self.v_dim)
                k_shared = mx.broadcast_to(rows[:, None, self.lora :], (length, self.heads, self.rope))
                keys = mx.concatenate([kv[..., : self.nope], k_shared], axis=-1)
                parts.append(causal_attention(q[start:end], keys, kv[..., self.nope :], self.scale))
        out = mx.concatenate(parts, axis=0)  # [T, H, v]
        return self.o(out.reshape(tokens, self.heads * self.v_dim))  # [T, H]


class DecoderLayer:
    """h + attn(norm(h)), then h + mlp(norm(h)). `attn` mixes tokens: attention, or a hybrid model's
    recurrent mixer (mlx_rank/gated_delta.py)."""

    def __init__(self, input_norm: RMSNorm, attn: Callable, post_norm: RMSNorm, mlp: Callable) -> None:
        self.input_norm, self.attn, self.post_norm, self.mlp = input_norm, attn, post_norm, mlp

    def __call__(self, hidden: mx.array, batch: MlxBatch) -> mx.array:
        hidden = hidden + self.attn(self.input_norm(hidden), batch)
        return hidden + self.mlp(self.post_norm(hidden))


class DecoderStack:
    """embed -> layers -> norm; `logits` is the lm_head, in float32."""

    def __init__(self, embed: mx.array, layers: list[Callable], norm: RMSNorm, lm_head: Linear) -> None:
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head

    def __call__(self, batch: MlxBatch) -> mx.array:
        hidden = self.embed[batch.input_ids]  # [T, H]
        if batch.image_rows is not None and batch.image_embeds is not None:  # placeholders take their image's rows
            hidden[batch.image_rows] = batch.image_embeds.astype(hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, batch)
        return self.norm(hidden)  # [T, H]

    def logits(self, hidden: mx.array) -> mx.array:
        return self.lm_head(hidden).astype(mx.float32)  # [R, V]

"""MLX mirrors of Gemma 4's pieces (layers/sandwich.py, models/gemma4.py): sliding-window attention, layers
reading another layer's cache, sandwich-normed layers with per-layer inputs and an optional expert block,
the scaled embedding and the softcapped logits. Same tensors, same order of operations."""

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from deployments.model_rank.mlx_rank.attention import DecoderStack, PagedCache, SelfAttention
from deployments.model_rank.mlx_rank.batch import MlxBatch
from deployments.model_rank.mlx_rank.hybrid_layers import ScaledRMSNorm
from deployments.model_rank.mlx_rank.layers import Linear, Rotary


def gelu_tanh(x: mx.array) -> mx.array:
    """kernels/activation.py's composition in float32, rounded once: x / (1 + exp(-2u))."""
    xf = x.astype(mx.float32)
    inner = 0.7978845608028654 * (xf + 0.044715 * xf * xf * xf)
    return (xf / (1 + mx.exp(-2 * inner))).astype(x.dtype)


def tanh(x: mx.array) -> mx.array:
    return 2 / (1 + mx.exp(-2 * x)) - 1


def unscaled_norm(x: mx.array, eps: float) -> mx.array:
    xf = x.astype(mx.float32)
    return (xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def windowed_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, window: int) -> mx.array:
    """One sequence's new queries over its context, each seeing its last `window` positions (0: all earlier
    ones), in float32: q [L, Hq, D], k [C, Hkv, D], v [C, Hkv, Dv] -> [L, Hq, Dv]."""
    num_q, num_k, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    qh = q.astype(mx.float32).transpose(1, 0, 2)
    kh = mx.repeat(k.astype(mx.float32), group, axis=1).transpose(1, 0, 2)
    vh = mx.repeat(v.astype(mx.float32), group, axis=1).transpose(1, 0, 2)
    scores = (qh @ kh.transpose(0, 2, 1)) * scale  # [Hq, L, C]
    key, position = mx.arange(num_k)[None, :], mx.arange(num_q)[:, None] + (num_k - num_q)
    hidden = key > position
    if window > 0:
        hidden = hidden | (key <= position - window)
    probs = mx.softmax(mx.where(hidden, -mx.inf, scores), axis=-1)
    return (probs @ vh).transpose(1, 0, 2).astype(q.dtype)


class GemmaAttention(SelfAttention):
    """Gemma 4's attention over its own cache: q/k norms, the unscaled v norm, V as K where `v` is None."""

    def __init__(self, q: Linear, k: Linear, v: Linear | None, o: Linear, norms: tuple, rotary: Rotary, shape: tuple):
        heads, kv_heads, head_dim, window, eps = shape
        super().__init__(q, k, v, o, norms[0], norms[1], rotary, heads, kv_heads, head_dim, 1.0)  # type: ignore[arg-type]
        self.window, self.eps = window, eps

    def __call__(self, hidden: mx.array, batch: MlxBatch) -> mx.array:
        tokens = hidden.shape[0]
        q = self.q_norm(self.q(hidden).reshape(tokens, self.heads, self.head_dim))
        k = self.k(hidden).reshape(tokens, self.kv_heads, self.head_dim)
        v = k if self.v is None else self.v(hidden).reshape(tokens, self.kv_heads, self.head_dim)
        q, k = self.rotary(batch, q, self.k_norm(k))
        self.cache.write(0, k, batch.slots)
        self.cache.write(1, unscaled_norm(v, self.eps), batch.slots)
        return self.o(attend(self.cache, q, batch, self.window).reshape(tokens, self.heads * self.head_dim))


class SharedAttention:
    """A kv-shared layer: only q is projected; it reads its source layer's cache (no cache of its own)."""

    def __init__(self, q: Linear, o: Linear, q_norm: ScaledRMSNorm, rotary: Rotary, source: GemmaAttention, heads: int):
        self.q, self.o, self.q_norm, self.rotary, self.source, self.heads = q, o, q_norm, rotary, source, heads

    def __call__(self, hidden: mx.array, batch: MlxBatch) -> mx.array:
        tokens, dim = hidden.shape[0], self.source.head_dim
        q = self.q_norm(self.q(hidden).reshape(tokens, self.heads, dim))
        q, _ = self.rotary(batch, q, q[:, :1])
        return self.o(attend(self.source.cache, q, batch, self.source.window).reshape(tokens, self.heads * dim))


def attend(cache: PagedCache, q: mx.array, batch: MlxBatch, window: int) -> mx.array:
    parts = []
    for (start, end), slots in zip(batch.spans, batch.context_slots):
        if end > start:
            keys, values = cache.context(0, slots).astype(q.dtype), cache.context(1, slots).astype(q.dtype)
            parts.append(windowed_attention(q[start:end], keys, values, 1.0, window))
    return mx.concatenate(parts, axis=0)  # [T, Hq, D]


class GeluMLP:
    def __init__(self, gate: Linear, up: Linear, down: Linear) -> None:
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x: mx.array) -> mx.array:
        return self.down(gelu_tanh(self.gate(x)) * self.up(x))


class ExpertBlock:
    """Gemma 4's experts beside the MLP: the scaled softmax router, GELU-tanh experts per routed row."""

    def __init__(self, router: tuple, experts: tuple[mx.array, mx.array, mx.array], norms: tuple, eps: float):
        self.proj, self.scale, self.per_expert, self.top_k, self.root = router
        self.gate_t, self.up_t, self.down_t = (w.swapaxes(-1, -2) for w in experts)
        mx.eval(self.gate_t, self.up_t, self.down_t)
        self.post_1, self.pre_2, self.post_2 = norms
        self.eps = eps

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        logits = self.proj(unscaled_norm(x, self.eps) * self.scale * self.root)
        probs = mx.softmax(logits.astype(mx.float32), axis=-1)
        ids = mx.argsort(-probs, axis=-1)[:, : self.top_k]
        weights = mx.take_along_axis(probs, ids, axis=-1)
        return weights / weights.sum(axis=-1, keepdims=True) * self.per_expert[ids], ids

    def __call__(self, dense: mx.array, residual: mx.array) -> mx.array:
        weights, ids = self.route(residual)
        x = self.pre_2(residual)
        tokens, top_k = ids.shape
        flat = np.array(ids).reshape(-1)  # [T * k]: token t's slot j at t * k + j
        out = mx.zeros((tokens * top_k, x.shape[1]), x.dtype)
        for expert in np.unique(flat).tolist():  # each routed expert over the rows sent to it
            where = np.nonzero(flat == expert)[0]
            rows = x[mx.array(where // top_k, mx.int32)]  # [n, H]
            hidden = gelu_tanh(rows @ self.gate_t[expert]) * (rows @ self.up_t[expert])
            out[mx.array(where, mx.int32)] = hidden @ self.down_t[expert]
        slots = (out.reshape(tokens, top_k, -1) * weights[:, :, None]).astype(x.dtype)
        total = slots[:, 0]
        for j in range(1, top_k):
            total = total + slots[:, j]  # each token's slots summed in its own order
        return self.post_1(dense) + self.post_2(total)


class SandwichLayer:
    """layers/sandwich.py's SandwichLayer (and its expert variant where `experts` is set)."""

    def __init__(self, mixer: Callable, mlp: Callable, norms: tuple, per_layer: tuple | None, scalar: mx.array):
        self.mixer, self.mlp = mixer, mlp
        self.input_norm, self.post_attn, self.pre_ff, self.post_ff = norms
        self.per_layer, self.scalar = per_layer, scalar
        self.experts: ExpertBlock | None = None

    def __call__(self, hidden: mx.array, batch: MlxBatch, per_layer_input: mx.array | None) -> mx.array:
        hidden = hidden + self.post_attn(self.mixer(self.input_norm(hidden), batch))
        fed = self.mlp(self.pre_ff(hidden))
        if self.experts is not None:
            fed = self.experts(fed, hidden)
        hidden = hidden + self.post_ff(fed)
        if per_layer_input is not None and self.per_layer is not None:
            gate, projection, norm = self.per_layer
            hidden = hidden + norm(projection(gelu_tanh(gate(hidden)) * per_layer_input))
        return hidden * self.scalar.astype(hidden.dtype)


class SandwichStack(DecoderStack):
    """The scaled embedding, per-layer inputs, the layers, the final norm; softcapped float32 logits."""

    def __init__(self, embed: mx.array, layers: list, norm: ScaledRMSNorm, lm_head: Linear, extras: tuple) -> None:
        super().__init__(embed, layers, norm, lm_head)  # type: ignore[arg-type]
        self.embed_scale, self.per_layer, self.softcap = extras

    def __call__(self, batch: MlxBatch) -> mx.array:
        hidden = self.embed[batch.input_ids] * self.embed_scale.astype(self.embed.dtype)
        inputs = None if self.per_layer is None else self.per_layer(batch.input_ids, hidden)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, batch, None if inputs is None else inputs[:, i])
        return self.norm(hidden)

    def logits(self, hidden: mx.array) -> mx.array:
        logits = self.lm_head(hidden).astype(mx.float32)
        return logits if self.softcap is None else tanh(logits / self.softcap) * self.softcap


class PerLayerInputs:
    def __init__(self, table: mx.array, projection: Linear, norm: ScaledRMSNorm, shape: tuple[int, int, int]):
        self.table, self.projection, self.norm = table, projection, norm
        self.layers, self.size, self.hidden_size = shape

    def __call__(self, input_ids: mx.array, embedded: mx.array) -> mx.array:
        scale = mx.array(self.size**0.5, mx.float32).astype(self.table.dtype)
        tokens = (self.table[input_ids] * scale).reshape(-1, self.layers, self.size)
        projected = self.projection(embedded) * (self.hidden_size**-0.5)
        projected = self.norm(projected.reshape(-1, self.layers, self.size))
        return (projected + tokens) * (2**-0.5)

"""Hyper-connections in MLX (layers/hyper_connections.py, GLM-5.3-Flash's mHC): `hc_mult` residual streams,
each block's mixing weights read from them per token, every sum over streams in one fixed order."""

import functools
from collections.abc import Callable

import mlx.core as mx

from deployments.model_rank.mlx_rank.attention import DecoderLayer, DecoderStack
from deployments.model_rank.mlx_rank.batch import MlxBatch
from deployments.model_rank.mlx_rank.layers import Linear, RMSNorm, sigmoid


def ordered_sum(x: mx.array, axis: int) -> mx.array:
    """x summed over `axis` (a few streams) first to last: the same bits whatever the array around it."""
    return functools.reduce(mx.add, [mx.take(x, i, axis=axis) for i in range(x.shape[axis])])


class HyperConnection:
    """One block's mixing weights from n streams [T, n, H]: `fn` [(2 + n) n, n H] (a float32 Linear), `base`
    [(2 + n) n] and `scale` [3] float32; `eps` the RMSNorm's, `hc_eps` and `iters` the Sinkhorn's."""

    def __init__(
        self, fn: Linear, base: mx.array, scale: mx.array, n: int, eps: float, hc_eps: float, iters: int
    ) -> None:
        self.fn, self.base, self.scale = fn, base.astype(mx.float32), scale.astype(mx.float32)
        self.n, self.eps, self.hc_eps, self.iters = n, eps, hc_eps, iters
        mx.eval(self.base, self.scale)  # MLX streams are per thread: not left for the engine's thread

    def __call__(self, streams: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(the block's input [T, H], post [T, n] and comb [T, n, n], float32)."""
        n, tokens, eps = self.n, streams.shape[0], self.hc_eps
        flat = streams.reshape(tokens, -1).astype(mx.float32)
        flat = flat * mx.rsqrt(mx.mean(flat * flat, axis=-1, keepdims=True) + self.eps)
        mix = self.fn(flat)  # [T, (2 + n) n]
        pre_w, post_w, comb_w = mix[:, :n], mix[:, n : 2 * n], mix[:, 2 * n :].reshape(tokens, n, n)
        pre_b, post_b, comb_b = self.base[:n], self.base[n : 2 * n], self.base[2 * n :].reshape(n, n)
        pre = sigmoid(pre_w * self.scale[0] + pre_b) + eps
        post = 2 * sigmoid(post_w * self.scale[1] + post_b)
        comb = mx.softmax(comb_w * self.scale[2] + comb_b, axis=-1) + eps
        comb = comb / (ordered_sum(comb, 1)[:, None, :] + eps)
        for _ in range(self.iters - 1):  # Sinkhorn: rows, then columns, towards a doubly stochastic matrix
            comb = comb / (ordered_sum(comb, 2)[:, :, None] + eps)
            comb = comb / (ordered_sum(comb, 1)[:, None, :] + eps)
        collapsed = ordered_sum(pre[:, :, None] * streams.astype(mx.float32), 1).astype(streams.dtype)
        return collapsed, post, comb


def merge_streams(streams: mx.array, out: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """post_i * out + sum_j comb_ji stream_j: [T, n, H] in the streams' dtype (the mix accumulated in float32
    from comb rounded to that dtype)."""
    dtype = streams.dtype
    weights = comb.astype(dtype).astype(mx.float32)
    mixed = ordered_sum(weights[:, :, :, None] * streams.astype(mx.float32)[:, :, None, :], 1).astype(dtype)
    return post.astype(dtype)[:, :, None] * out[:, None, :] + mixed


class HyperLayer(DecoderLayer):
    """A decoder layer over n residual streams, each block through its own HyperConnection."""

    def __init__(
        self,
        input_norm: RMSNorm,
        attn: Callable,
        post_norm: RMSNorm,
        mlp: Callable,
        connections: tuple[HyperConnection, HyperConnection],
    ) -> None:
        super().__init__(input_norm, attn, post_norm, mlp)
        self.attn_hc, self.ffn_hc = connections

    def __call__(self, streams: mx.array, batch: MlxBatch) -> mx.array:
        block_in, post, comb = self.attn_hc(streams)
        streams = merge_streams(streams, self.attn(self.input_norm(block_in), batch), post, comb)
        block_in, post, comb = self.ffn_hc(streams)
        return merge_streams(streams, self.mlp(self.post_norm(block_in)), post, comb)


class HyperStack(DecoderStack):
    """embed -> n copies -> HyperLayers -> their mean -> norm."""

    def __init__(self, embed: mx.array, layers: list[Callable], norm: RMSNorm, lm_head: Linear, streams: int) -> None:
        super().__init__(embed, layers, norm, lm_head)
        self.streams = streams

    def __call__(self, batch: MlxBatch) -> mx.array:
        hidden = self.embed[batch.input_ids]  # [T, H]
        streams = mx.broadcast_to(hidden[:, None, :], (hidden.shape[0], self.streams, hidden.shape[1]))
        for layer in self.layers:
            streams = layer(streams, batch)
        mean = (ordered_sum(streams.astype(mx.float32), 1) / self.streams).astype(hidden.dtype)
        return self.norm(mean)  # [T, H]

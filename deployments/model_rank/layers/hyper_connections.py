"""Manifold-constrained hyper-connections (GLM-5.3-Flash's mHC): the residual is `hc_mult` streams, not one.

Before each block (attention, then MLP) a layer reads mixing weights from its streams, each token on its own:
    m = RMSNorm(streams flattened) @ fn^T;   pre = sigmoid(m_pre * s0 + b_pre) + eps
    post = 2 sigmoid(m_post * s1 + b_post);  comb = Sinkhorn(softmax(m_comb * s2 + b_comb) + eps)
the block reads sum_j pre_j stream_j, and the streams become post_i * out + sum_j comb_ji stream_j. The stack
starts every stream as the token's embedding and ends with their mean, then the final norm.
Exactness: every sum over streams runs in one fixed order per token, and the projection is row-invariant.
"""

import torch
from torch import nn

from deployments.model_rank.forward_batch import ForwardBatch
from deployments.model_rank.layers.decoder import DecoderLayer, DecoderStack
from deployments.model_rank.layers.linear import invariant_linear
from deployments.model_rank.layers.parallel import default_loader
from kernels import dispatch
from kernels.hyper_mix import ordered_sum


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = default_loader
    return param


class HyperConnection(nn.Module):
    """One block's mixing weights from `streams` [T, n, H] (fn, base and scale: the checkpoint's
    `hc_{attn,ffn}_{fn,base,scale}`; base and scale stay float32 as the reference keeps them)."""

    def __init__(self, streams: int, hidden_size: int, eps: float, hc_eps: float, sinkhorn_iters: int) -> None:
        super().__init__()
        self.n, self.eps, self.hc_eps, self.iters = streams, eps, hc_eps, sinkhorn_iters
        width = (2 + streams) * streams
        self.fn = _param(width, streams * hidden_size)
        self.base = _param(width, dtype=torch.float32)
        self.scale = _param(3, dtype=torch.float32)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the block's input [T, H], post [T, n] and comb [T, n, n], float32)."""
        flat = streams.reshape(streams.shape[0], -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.eps)
        mix = invariant_linear(flat, self.fn.float())  # [T, (2 + n) n]
        pre, post, comb = dispatch.hyper_weights(mix, self.base, self.scale, self.n, self.iters, self.hc_eps)
        return dispatch.hyper_collapse(streams, pre), post, comb


class HyperLayer(DecoderLayer):
    """A decoder layer over `n` residual streams: each block reads and writes them through its own
    HyperConnection (registered as the checkpoint's `hc_attn_*` and `hc_ffn_*`)."""

    def __init__(
        self, mixer: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, hc: "HyperConnectionKeys"
    ) -> None:
        super().__init__(mixer, mlp, hidden_size, eps)
        self.attn_hc = HyperConnection(hc.streams, hidden_size, eps, hc.eps, hc.sinkhorn_iters)
        self.ffn_hc = HyperConnection(hc.streams, hidden_size, eps, hc.eps, hc.sinkhorn_iters)

    def forward(self, streams: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        block_in, post, comb = self.attn_hc(streams)
        streams = dispatch.hyper_merge(streams, self.mixer(self.input_layernorm(block_in), batch), post, comb)
        block_in, post, comb = self.ffn_hc(streams)
        return dispatch.hyper_merge(streams, self.mlp(self.post_attention_layernorm(block_in)), post, comb)


class HyperConnectionKeys:
    """config.json's `hc_mult`, `hc_eps` and `hc_sinkhorn_iters` (defaults: transformers')."""

    def __init__(self, streams: int = 4, eps: float = 1e-6, sinkhorn_iters: int = 20) -> None:
        if streams < 1 or sinkhorn_iters < 1:
            raise ValueError(f"hc_mult ({streams}) and hc_sinkhorn_iters ({sinkhorn_iters}) must be at least 1")
        self.streams, self.eps, self.sinkhorn_iters = streams, eps, sinkhorn_iters


class HyperStack(DecoderStack):
    """embed_tokens -> n copies -> HyperLayers -> their mean -> norm."""

    def __init__(self, vocab_size: int, hidden_size: int, layers: list[HyperLayer], eps: float, streams: int) -> None:
        super().__init__(vocab_size, hidden_size, layers, eps)
        self.streams = streams

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed(batch)  # [T, H]
        streams = hidden[:, None, :].expand(-1, self.streams, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, batch)
        mean = (ordered_sum(streams.float(), 1) / self.streams).to(hidden.dtype)
        return self.norm(mean)

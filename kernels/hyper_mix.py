"""Hyper-connection weights per token (GLM-5.3-Flash's mHC): a torch reference and one native call on CPU.

From a block's projection `mix` [T, (2 + n) n] float32, its `base` [(2 + n) n] and `scale` [3]
(deployments/model_rank/layers/hyper_connections.py),
    pre = sigmoid(mix_pre * s0 + b_pre) + eps,  post = 2 sigmoid(mix_post * s1 + b_post),
    comb = Sinkhorn(softmax_rows(mix_comb * s2 + b_comb) + eps): columns, then (iters - 1) x (rows, columns)
each normalised by its sum + eps; then the streams' collapse into the block's input and their merge with its
output. The torch functions are the reference (and the CUDA path); on CPU one native call each computes the
same (kernels/cpu/hyper_mix.c), each token in its own fixed order either way.
"""

import functools

import torch

from kernels import cpu_native
from kernels.activation import sigmoid
from kernels.cpu_attention import DTYPE_CODES


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x summed over `dim` (a few streams) first to last: the same bits whatever the tensor around it."""
    return functools.reduce(torch.add, x.unbind(dim))


def hyper_weights_torch(
    mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [T, n], post [T, n], comb [T, n, n]) float32."""
    tokens = mix.shape[0]
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(tokens, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (ordered_sum(comb, 1)[:, None, :] + eps)
    for _ in range(iters - 1):  # Sinkhorn: rows, then columns, towards a doubly stochastic matrix
        comb = comb / (ordered_sum(comb, 2)[:, :, None] + eps)
        comb = comb / (ordered_sum(comb, 1)[:, None, :] + eps)
    return pre, post, comb


def native_supported(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int) -> bool:
    tensors = (mix, base, scale)
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
        and 1 <= n <= 16
        and cpu_native.available()
    )


def hyper_weights_native(
    mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hyper_weights_torch's result from one native call (CPU, float32, at most 16 streams)."""
    lib = cpu_native.library()
    assert lib is not None
    tokens = mix.shape[0]
    pre, post = mix.new_empty(tokens, n), mix.new_empty(tokens, n)
    comb = mix.new_empty(tokens, n, n)
    pointers = (mix.data_ptr(), base.data_ptr(), scale.data_ptr())
    outs = (pre.data_ptr(), post.data_ptr(), comb.data_ptr())
    if lib.tf_hyper_weights(*pointers, tokens, n, iters, eps, *outs, cpu_native.threads()) != 0:
        raise ValueError(f"hyper-connection weights for {n} streams (at most 16)")
    return pre, post, comb


def collapse_torch(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """The block's input [T, H]: sum_j pre_j stream_j in float32, rounded to the streams' dtype once."""
    return ordered_sum(pre[:, :, None] * streams, 1).to(streams.dtype)


def merge_torch(streams: torch.Tensor, block: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """post_i * block + sum_j comb_ji stream_j: [T, n, H] in the streams' dtype (the mix accumulated in float32
    from comb rounded to that dtype, as the reference model's matmul)."""
    dtype = streams.dtype
    weights = comb.to(dtype).float()
    mixed = ordered_sum(weights[:, :, :, None] * streams.float()[:, :, None, :], 1).to(dtype)
    return post.to(dtype)[:, :, None] * block[:, None, :] + mixed


def native_streams(streams: torch.Tensor, *others: torch.Tensor) -> bool:
    """CPU, contiguous, a dtype the native kernels take, at most 16 streams."""
    return (
        streams.dtype in DTYPE_CODES
        and streams.shape[1] <= 16
        and all(t.device.type == "cpu" and t.is_contiguous() for t in (streams, *others))
        and cpu_native.available()
    )


def collapse_native(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    lib = cpu_native.library()
    assert lib is not None
    tokens, n, hidden = streams.shape
    out = streams.new_empty(tokens, hidden)
    args = (streams.data_ptr(), pre.data_ptr(), out.data_ptr(), tokens, n, hidden)
    lib.tf_hyper_collapse(*args, DTYPE_CODES[streams.dtype], cpu_native.threads())
    return out


def merge_native(streams: torch.Tensor, block: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    lib = cpu_native.library()
    assert lib is not None
    tokens, n, hidden = streams.shape
    out = torch.empty_like(streams)
    pointers = (streams.data_ptr(), block.data_ptr(), post.data_ptr(), comb.data_ptr(), out.data_ptr())
    lib.tf_hyper_merge(*pointers, tokens, n, hidden, DTYPE_CODES[streams.dtype], cpu_native.threads())
    return out

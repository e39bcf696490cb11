"""Hyper-connection weights per token (GLM-5.3-Flash's mHC): a torch reference and one native call on CPU.

From a block's projection `mix` [T, (2 + n) n] float32, its `base` [(2 + n) n] and `scale` [3]
(deployments/model_rank/layers/hyper_connections.py),
    pre = sigmoid(mix_pre * s0 + b_pre) + eps,  post = 2 sigmoid(mix_post * s1 + b_post),
    comb = Sinkhorn(softmax_rows(mix_comb * s2 + b_comb) + eps): columns, then (iters - 1) x (rows, columns)
each normalised by its sum + eps. `hyper_weights_torch` is the reference (and the CUDA path); on CPU one native
call per block computes the same (kernels/cpu/hyper_mix.c), each token in its own fixed order either way.
"""

import functools

import torch

from kernels import cpu_native
from kernels.activation import sigmoid


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

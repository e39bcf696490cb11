"""Activations whose result for an element does not depend on where it sits in the tensor.

torch's CPU float32/float64 `silu` and `sigmoid` give different bits in their vectorised body and their
scalar tail, so an element's value moved with the tensor's size (e.g. one decode row vs a prefill). `exp`,
add and divide were measured identical in both paths, so float32/64 are composed from them; bf16/fp16
kernels round to the narrow dtype and were measured path-independent.
"""

import torch
import torch.nn.functional as F

_WIDE = (torch.float32, torch.float64)


def silu(x: torch.Tensor) -> torch.Tensor:
    if x.dtype in _WIDE:
        return x / (1 + torch.exp(-x))
    return F.silu(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    if x.dtype in _WIDE:
        return 1 / (1 + torch.exp(-x))
    return torch.sigmoid(x)


def tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh(x) = 2 / (1 + exp(-2x)) - 1 in float32/64 (torch's own tanh has the same two paths as silu)."""
    if x.dtype in _WIDE:
        return 2 / (1 + torch.exp(-2 * x)) - 1
    return torch.tanh(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (transformers' `gelu_pytorch_tanh`), composed in float32 for narrow dtypes:
    x (1 + tanh(u)) / 2 = x / (1 + exp(-2u)), which has no cancellation where u is large and negative."""
    wide = x if x.dtype in _WIDE else x.float()
    inner = 0.7978845608028654 * (wide + 0.044715 * wide * wide * wide)  # u = sqrt(2 / pi) (x + 0.044715 x^3)
    return (wide / (1 + torch.exp(-2 * inner))).to(x.dtype)

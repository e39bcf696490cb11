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

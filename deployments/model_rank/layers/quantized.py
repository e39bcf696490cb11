"""Projection weights kept as GGUF blocks (docs/gguf.md): which parameters may take them, putting a file's
raw blocks in place of a parameter's float storage, and reading a weight's block type back.

A kept weight is a uint8 parameter [N, row_bytes] (or a stack [E, N, row_bytes] of experts) tagged with its
GGUF type; `invariant_linear` and the embedding hand it to kernels/quant_gemm.py's fixed-order kernels.
"""

import torch
from torch import nn

QUANT_TYPE = "gguf_qtype"  # the attribute naming a kept weight's GGUF type


def takes_blocks(param: nn.Parameter) -> bool:
    return getattr(param, "takes_blocks", False)


def put_blocks(
    param: nn.Parameter, data: torch.Tensor, qtype: str, shape: tuple[int, int], expert_id: int | None
) -> None:
    """Make `param` (or its expert `expert_id`) the blocks `data` [N, row_bytes] of a [N, K] weight."""
    if tuple(param.shape[-2:]) != shape and qtype_of(param) is None:
        raise ValueError(f"shape {shape} does not match the parameter's {tuple(param.shape[-2:])}")
    current = qtype_of(param)
    if current is not None and current != qtype:
        raise ValueError(f"type {qtype} differs from the {current} of the stack's other experts")
    if expert_id is None:
        _retag(param, data, qtype)
        return
    if current is None:
        experts = getattr(param, "expert_count", param.shape[0])
        _retag(param, torch.empty(experts, *data.shape, dtype=torch.uint8), qtype)
    if tuple(param.shape[1:]) != tuple(data.shape):
        raise ValueError(f"expert blocks {tuple(data.shape)} differ from the stack's {tuple(param.shape[1:])}")
    param.data[expert_id].copy_(data)


def _retag(param: nn.Parameter, data: torch.Tensor, qtype: str) -> None:
    param.compute_dtype = param.dtype if qtype_of(param) is None else param.compute_dtype
    param.data = data
    setattr(param, QUANT_TYPE, qtype)


def qtype_of(weight: torch.Tensor) -> str | None:
    """The GGUF type of a kept weight, or of the stack an expert's matrix `stack[e]` is a view of."""
    found = getattr(weight, QUANT_TYPE, None)
    if found is None and weight._base is not None:
        found = getattr(weight._base, QUANT_TYPE, None)
    return found


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the model computes in where `weight` is kept as blocks."""
    base = weight if hasattr(weight, "compute_dtype") else weight._base
    return base.compute_dtype

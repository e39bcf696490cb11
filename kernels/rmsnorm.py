"""RMSNorm, optionally fused with the residual add before it (one read of each input, one write each).

Numerics follow the Hugging Face convention of layers/norm.py: the residual sum is rounded to the model
dtype (it is the new residual stream), normalised in float32, rounded back, then scaled by the weight with
the result in the promoted dtype of weight and input.
"""

import torch

from kernels._triton import jit, next_pow2, tl
from kernels.checks import (
    FLOAT_DTYPES,
    check_device,
    check_dim,
    check_dtype,
    check_last_contiguous,
    check_same_dtype,
    output_buffer,
)


@jit
def _rmsnorm_kernel(
    x_ptr,  # [N, H]
    residual_ptr,  # [N, H] (read only when HAS_RESIDUAL)
    weight_ptr,  # [H]
    out_ptr,  # [N, H]
    sum_ptr,  # [N, H]: x + residual (written only when HAS_RESIDUAL)
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded like the unfused add
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers/norm.py's RMSNorm.forward: x [..., H] -> [..., H]."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def wide_rms_norm_torch(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm whose float32 `scale` multiplies the float32 normalised row, rounded once (layers/norm.py's
    WideScaleRMSNorm): x [..., H] -> [..., H]."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the decoder's `h = h + sublayer(...); norm(h)` in one call."""
    summed = x + residual
    return rms_norm_torch(summed, weight, eps), summed


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, FLOAT_DTYPES)
    if weight.dim() != 1:
        raise ValueError(f"weight must be [hidden], got shape {tuple(weight.shape)}")
    check_dim("x", x, -1, weight.shape[0], "features")
    check_last_contiguous("x", x)
    check_last_contiguous("weight", weight)
    named = [("x", x), ("weight", weight)]
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        check_same_dtype("x and residual", x, residual)
        check_last_contiguous("residual", residual)
        named.append(("residual", residual))
    check_device(*named)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [N, H] without copying when the leading dims flatten (they do for the layers' tensors)."""
    return t.reshape(-1, t.shape[-1])


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    out: torch.Tensor | None,
    summed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = _rows(x)  # [N, H]
    res2 = _rows(residual) if residual is not None else x2
    out2 = output_buffer(
        None if out is None else _rows(out), "out", x2.shape, torch.promote_types(weight.dtype, x.dtype), x.device
    )
    sum2 = (
        output_buffer(None if summed is None else _rows(summed), "summed", x2.shape, x.dtype, x.device)
        if residual is not None
        else x2
    )
    if x2.shape[0]:
        _rmsnorm_kernel[(x2.shape[0],)](
            x2,
            res2,
            weight,
            out2,
            sum2,
            x2.shape[1],
            eps,
            x2.stride(0),
            res2.stride(0),
            out2.stride(0),
            sum2.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=next_pow2(x2.shape[1]),
        )
    return out2.view(x.shape), sum2.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton RMSNorm: x [..., H], weight [H] -> [..., H] in promote(weight, x) dtype (into `out` if given)."""
    _check(x, weight, None)
    return _launch(x, weight, eps, None, out, None)[0]


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    summed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton fused (rms_norm(x + residual), x + residual), into `out` / `summed` if given."""
    _check(x, weight, residual)
    return _launch(x, weight, eps, residual, out, summed)

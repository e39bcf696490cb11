"""RMSNorm, rotate-half RoPE, SiLU(gate) * up and greedy argmax on CPU, one native call each
(kernels/cpu/layer_ops.c).

A decoder layer's elementwise parts were a few dozen small torch ops, each a dispatch and an allocation:
at decode shapes they cost as much as the layer's attention. These kernels compute each row on its own
(batch-invariant); RoPE rounds where torch rounds, so it gives torch's bits. RMSNorm's sum of squares and
SiLU's exp are their own: rounded to bfloat16 or float16 they agree with torch nearly always (bfloat16:
every element of the tests' samples), so the dispatcher uses them for those types and keeps torch's float32.
"""

import weakref

import torch

from kernels import cpu_native
from kernels.cpu_attention import DTYPE_CODES
from kernels.rotary import cos_sin

NARROW = (torch.bfloat16, torch.float16)  # where RMSNorm and SiLU run natively
_COS_SIN: list[tuple[weakref.ref, torch.Tensor, float, torch.dtype, tuple[torch.Tensor, torch.Tensor]]] = []


def supports(*tensors: torch.Tensor) -> bool:
    """CPU tensors of one floating type, contiguous, with the native kernels on (a plain loop: this runs
    several times per layer)."""
    dtype = tensors[0].dtype
    if dtype not in DTYPE_CODES:
        return False
    for tensor in tensors:
        if tensor.dtype != dtype or tensor.is_cuda or not tensor.is_contiguous():
            return False
    return tensors[0].device.type == "cpu" and cpu_native.available()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x [+ residual]), x [+ residual]) over the last dim, in x's dtype."""
    lib = cpu_native.library()
    assert lib is not None
    hidden = x.shape[-1]
    rows = x.numel() // hidden if hidden else 0
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    lib.tf_rms_norm(
        x.data_ptr(),
        residual.data_ptr() if residual is not None else None,
        weight.data_ptr(),
        out.data_ptr(),
        summed.data_ptr(),
        rows,
        hidden,
        eps,
        DTYPE_CODES[x.dtype],
        cpu_native.threads(),
    )
    return out, summed


def rms_norm_wide(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with the weight applied to the float32 normalised row, rounded once, in x's dtype."""
    lib = cpu_native.library()
    assert lib is not None
    hidden = x.shape[-1]
    rows = x.numel() // hidden if hidden else 0
    out = torch.empty_like(x)
    args = (x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, hidden, eps)
    lib.tf_rms_norm_wide(*args, DTYPE_CODES[x.dtype], cpu_native.threads())
    return out


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [T, Hq, D] and k [T, Hk, D] over the first 2 * len(inv_freq) features."""
    lib = cpu_native.library()
    assert lib is not None
    cos, sin = _cos_sin(positions, inv_freq, scaling, q.dtype)  # [T, rot] each
    rot = cos.shape[-1]
    rotated = []
    for x in (q, k):
        out = torch.empty_like(x)
        tokens, heads, dim = x.shape
        lib.tf_rotary(
            x.data_ptr(),
            out.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            tokens,
            heads,
            dim,
            rot,
            DTYPE_CODES[x.dtype],
            cpu_native.threads(),
        )
        rotated.append(out)
    return rotated[0], rotated[1]


def rows_of(gate: torch.Tensor, up: torch.Tensor) -> int | None:
    """The row stride gate and up share: contiguous tensors of one shape, or [T, I] halves of one fused
    [T, 2I] output (None: a layout silu_mul does not take)."""
    if gate.shape != up.shape:
        return None
    if gate.is_contiguous() and up.is_contiguous():
        return gate.shape[-1] if gate.dim() else None
    if gate.dim() != 2 or gate.stride(1) != 1 or up.stride(1) != 1 or gate.stride(0) != up.stride(0):
        return None
    return gate.stride(0)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, stride: int) -> torch.Tensor:
    """silu(gate) * up, elementwise, in their dtype; rows of gate and up are `stride` elements apart."""
    return _gated("tf_silu_mul", gate, up, stride)


def _gated(kernel: str, gate: torch.Tensor, up: torch.Tensor, stride: int) -> torch.Tensor:
    """One of layer_ops.c's act(gate) * up kernels over rows `stride` elements apart."""
    lib = cpu_native.library()
    assert lib is not None
    cols = gate.shape[-1]
    rows = gate.numel() // cols if cols else 0
    out = torch.empty(gate.shape, dtype=gate.dtype)
    args = (gate.data_ptr(), up.data_ptr(), out.data_ptr(), rows, cols, stride)
    getattr(lib, kernel)(*args, DTYPE_CODES[gate.dtype], cpu_native.threads())
    return out


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """torch.argmax(logits, dim=-1) of float32 rows [R, V] (lowest index on ties, the first NaN if any)."""
    lib = cpu_native.library()
    assert lib is not None
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    lib.tf_argmax_rows(logits.data_ptr(), rows, cols, out.data_ptr(), cpu_native.threads())
    return out.tolist()


def _cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's cos/sin table [T, rot] for these positions, computed once per step for all the layers."""
    if _COS_SIN:
        owner, freqs, scale, kind, table = _COS_SIN[0]
        if owner() is positions and freqs is inv_freq and scale == scaling and kind == dtype:
            return table
    cos, sin = cos_sin(positions, inv_freq, scaling, dtype)  # [T, 1, rot]
    table = (cos[:, 0].contiguous(), sin[:, 0].contiguous())
    _COS_SIN[:] = [(weakref.ref(positions), inv_freq, scaling, dtype, table)]
    return table


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor, stride: int) -> torch.Tensor:
    """gelu_tanh(gate) * up, elementwise, in their dtype; rows `stride` elements apart, as silu_mul's."""
    return _gated("tf_gelu_tanh_mul", gate, up, stride)

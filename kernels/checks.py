"""Argument checks shared by the kernel wrappers: one clear error instead of a wrong read on the GPU."""

import torch

from kernels._triton import HAS_TRITON, interpreting

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_rank(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")


def check_dim(name: str, t: torch.Tensor, dim: int, size: int, what: str) -> None:
    if t.shape[dim] != size:
        raise ValueError(f"{name} has {t.shape[dim]} {what} (dim {dim}), expected {size}: shape {tuple(t.shape)}")


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{name} has dtype {t.dtype}, expected one of {', '.join(str(d) for d in allowed)}")


def check_same_dtype(names: str, *tensors: torch.Tensor) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise TypeError(f"{names} must share one dtype, got {sorted(str(d) for d in dtypes)}")


def check_last_contiguous(name: str, t: torch.Tensor) -> None:
    """Kernels step through the last dimension with unit stride."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last dimension, got strides {t.stride()}")


def check_device(*named: tuple[str, torch.Tensor]) -> None:
    """All tensors on one device, and one the kernels can run on (CUDA, or CPU under the interpreter)."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed: use the torch path (kernels.dispatch does this on CPU)")
    devices = {t.device for _, t in named}
    if len(devices) != 1:
        listing = ", ".join(f"{n}={t.device}" for n, t in named)
        raise ValueError(f"tensors must share one device, got {listing}")
    device = devices.pop()
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreting():
        return
    raise ValueError(f"Triton kernels run on CUDA tensors (or on CPU under TRITON_INTERPRET=1), got {device}")


def output_buffer(
    given: torch.Tensor | None, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The caller's output buffer (checked: kernels write it densely) or a new one."""
    if given is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if (
        tuple(given.shape) != tuple(shape)
        or given.dtype != dtype
        or given.device != device
        or not given.is_contiguous()
    ):
        raise ValueError(
            f"{name} must be a contiguous {dtype} tensor of shape {tuple(shape)} on {device}, "
            f"got {given.dtype} {tuple(given.shape)} on {given.device}"
        )
    return given

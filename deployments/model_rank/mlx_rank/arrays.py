"""Moving tensors between torch and MLX without changing a bit (bfloat16 included, which numpy lacks)."""

import mlx.core as mx
import numpy as np
import torch

TORCH_TO_MX = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}
MX_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


def from_torch(tensor: torch.Tensor) -> mx.array:
    """A copy of a CPU torch tensor as an MLX array of the same dtype and shape."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return mx.array(tensor.view(torch.int16).numpy()).view(mx.bfloat16)
    return mx.array(tensor.numpy())


def to_torch(array: mx.array) -> torch.Tensor:
    """An MLX array as a CPU torch tensor (evaluates it)."""
    if array.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(array.view(mx.int16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(array))


def as_bytes(array: mx.array) -> np.ndarray:
    """The array's raw bytes, [rows, bytes per row] for a [rows, ...] array."""
    raw = array.view(mx.uint8) if array.dtype != mx.bfloat16 else array.view(mx.int16).view(mx.uint8)
    return np.array(raw).reshape(array.shape[0], -1)


def from_bytes(data: np.ndarray, dtype: mx.Dtype, shape: tuple[int, ...]) -> mx.array:
    """Rows made by `as_bytes` back into an array of `dtype` and `shape`."""
    return mx.array(np.ascontiguousarray(data)).view(dtype).reshape(shape)

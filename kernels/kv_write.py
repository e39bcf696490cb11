"""Writing the step's new K/V (or MLA latent) rows into the paged cache at their slots.

Slot s is row s % block_size of block s // block_size. A negative slot means "do not store" (a padded
token), as in vLLM's slot mappings; the torch path skips it too.
"""

import torch

from kernels._triton import jit, next_pow2, tl
from kernels.checks import FLOAT_DTYPES, check_device, check_dim, check_dtype, check_last_contiguous


@jit
def _kv_write_kernel(
    values_ptr,  # [T, H, D]
    cache_ptr,  # [blocks, block_size, H, D]
    slots_ptr,  # [T] int64
    num_heads,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < num_heads) & (d[None, :] < DIM)
    rows = tl.load(values_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = (
        cache_ptr
        + (slot // BLOCK_SIZE) * stride_cb
        + (slot % BLOCK_SIZE) * stride_cs
        + h[:, None] * stride_ch
        + d[None, :]
    )
    tl.store(dst, rows.to(cache_ptr.dtype.element_ty), mask=mask)


def write_cache_torch(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """layers/attention.py's write_cache: values [T, ...] to cache [blocks, block_size, ...] at their slots."""
    flat = cache.view(-1, *cache.shape[2:])  # [blocks * block_size, ...]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, values = slot_mapping[keep], values[keep]
    flat.index_copy_(0, slot_mapping, values.to(cache.dtype))


def _as_heads(t: torch.Tensor, lead: int) -> torch.Tensor:
    """[lead..., D] -> [lead..., H, D]: a latent row is one head."""
    return t.unsqueeze(-2) if t.dim() == lead + 1 else t


def write_cache(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton write: cache [blocks, bs, H, D] or [blocks, bs, D]; values [T, H, D] or [T, D]; slot_mapping [T]."""
    if cache.dim() not in (3, 4) or values.dim() != cache.dim() - 1:
        raise ValueError(
            f"cache {tuple(cache.shape)} and values {tuple(values.shape)} must be [blocks, bs, (H,) D] and [T, (H,) D]"
        )
    if tuple(values.shape[1:]) != tuple(cache.shape[2:]):
        raise ValueError(f"values rows {tuple(values.shape[1:])} do not match cache rows {tuple(cache.shape[2:])}")
    check_dim("slot_mapping", slot_mapping, 0, values.shape[0], "tokens")
    check_dtype("cache", cache, FLOAT_DTYPES)
    check_dtype("values", values, FLOAT_DTYPES)
    check_dtype("slot_mapping", slot_mapping, (torch.int64, torch.int32))
    check_last_contiguous("values", values)
    check_last_contiguous("cache", cache)
    check_device(("cache", cache), ("values", values), ("slot_mapping", slot_mapping))
    cache4, values3 = _as_heads(cache, 2), _as_heads(values, 1)
    if values3.shape[0] == 0:
        return
    _kv_write_kernel[(values3.shape[0],)](
        values3,
        cache4,
        slot_mapping,
        values3.shape[1],
        values3.stride(0),
        values3.stride(1),
        cache4.stride(0),
        cache4.stride(1),
        cache4.stride(2),
        DIM=values3.shape[2],
        BLOCK_SIZE=cache4.shape[1],
        BLOCK_H=next_pow2(values3.shape[1]),
        BLOCK_D=next_pow2(values3.shape[2]),
    )

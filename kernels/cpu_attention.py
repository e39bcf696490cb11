"""Paged causal attention on CPU in float32 with a fixed per-row order (kernels/cpu/paged_attention.c).

Each (query row, head) is computed whole by one thread over its own keys in ascending order, so a row's
bits never depend on how many rows, sequences or threads share the step; no K/V gather copies are made. On
a sliding-window layer a row's keys are its window's alone.
"""

import weakref
from dataclasses import dataclass

import torch

from kernels import cpu_native

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_HEAD_DIM = 256  # paged_attention.c keeps a q row and a V accumulator of this many floats in registers


@dataclass
class RowLayout:
    """Where each query row of one step reads its keys (built once per step, shared by every layer)."""

    tables: torch.Tensor  # [sum of blocks] int64: every sequence's block ids, one after another
    table_starts: torch.Tensor  # [S] int64: where each sequence's ids start in `tables`
    row_seq: torch.Tensor  # [T] int64: each query row's sequence
    row_pos: torch.Tensor  # [T] int64: each query row's position (it sees keys 0..pos)
    max_keys: int


_LAYOUT: list[tuple[weakref.ref, RowLayout]] = []


def row_layout(
    query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], owner: object | None = None
) -> RowLayout:
    """The step's row layout, cached on `owner` (the step's batch object) for the layers after the first."""
    if owner is not None and _LAYOUT and _LAYOUT[0][0]() is owner:
        return _LAYOUT[0][1]
    tables: list[int] = []
    starts: list[int] = []
    row_seq: list[int] = []
    row_pos: list[int] = []
    for s, (n, length, table) in enumerate(zip(query_lens, context_lens, block_tables)):
        starts.append(len(tables))
        tables.extend(table)
        row_seq.extend([s] * n)
        row_pos.extend(range(length - n, length))
    as_long = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    layout = RowLayout(
        as_long(tables), as_long(starts), as_long(row_seq), as_long(row_pos), max(context_lens, default=0)
    )
    if owner is not None:
        _LAYOUT[:] = [(weakref.ref(owner), layout)]
    return layout


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (
        cpu_native.available()
        and q.device.type == "cpu"
        and q.dtype in DTYPE_CODES
        and k_cache.dtype == q.dtype
        and v_cache.dtype == q.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and q.shape[-1] <= MAX_HEAD_DIM
        and v_cache.shape[-1] <= MAX_HEAD_DIM
        and q.shape[1] % k_cache.shape[2] == 0
    )


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: RowLayout, scale: float, window: int = 0
) -> torch.Tensor:
    """q [T, Hq, D] over caches [blocks, bs, Hkv, D|Dv] -> [T, Hq, Dv] (K/V of this step already written);
    `window` > 0: a row at position p sees keys p - window + 1..p only (a sliding-window layer)."""
    lib = cpu_native.library()
    assert lib is not None
    q = q.contiguous()
    rows, heads, dim = q.shape
    _, block_size, kv_heads, v_dim = v_cache.shape
    out = torch.empty(rows, heads, v_dim, dtype=q.dtype)
    if rows == 0:
        return out
    lib.tf_paged_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        layout.tables.data_ptr(),
        layout.table_starts.data_ptr(),
        layout.row_seq.data_ptr(),
        layout.row_pos.data_ptr(),
        rows,
        heads,
        kv_heads,
        dim,
        v_dim,
        block_size,
        layout.max_keys,
        window,
        scale,
        DTYPE_CODES[q.dtype],
        cpu_native.threads(),
    )
    return out

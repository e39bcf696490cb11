"""The recurrent layers' scans on CPU in one native call each (kernels/cpu/recurrent.c): the causal conv,
the delta rule of Gated DeltaNet and of Kimi delta attention, and Mamba2's state update, over a step's
sequences (recurrent_scan.ScanRows).

The torch reference (recurrent_scan.py) runs a dozen small ops per token per sequence per layer; these run
token after token per sequence in C, in a fixed order per element, threads splitting (sequence, head)
pairs only, so a token's bits never depend on its chunk, its batch or the thread count. The conv computes
torch's bits; the recurrences sum in their own fixed order (within float32 rounding of torch's), and their
softplus / exp are libm's. Mamba2's step is rounded where torch rounds it (the bfloat16 sum and softplus).

Unlike cpu_native's AMX library this one is portable C that needs only a C compiler with OpenMP, built for
the widest vectors the CPU has (an element's ops do not change with the width).
"""

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
from pathlib import Path

import torch

from kernels import cpu_native
from kernels.recurrent_scan import ScanRows

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cpu" / "recurrent.c"
# -ffp-contract=off: a multiply and an add stay two roundings, whatever the vector width.
BASE_FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off"]
WIDEST = (("avx512f", "-mavx512f"), ("avx2", "-mavx2"))  # the first this CPU has widens the vectors
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# Below this many elements touched (tokens x state or channels), a call runs on one thread: a decode step's
# conv and one sequence's few heads cost less than waking the others. Results never depend on it.
PARALLEL_WORK = 1 << 18

_ptr, _i64, _int, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ROWS = [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr]  # starts, ends, slots, cap_begin, cap_rows, cap_slots
SIGNATURES = {
    "tf_causal_conv_scan": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, *_ROWS, _i64, _i64, _i64, _int, _int, _i64],
    "tf_gated_delta_scan": [_ptr, _ptr, _ptr, _ptr, _ptr, _int, _ptr, _ptr, _ptr, _int, _ptr, *_ROWS]
    + [_i64, _i64, _i64, _i64, _int, _i64],
    "tf_kda_scan": [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, *_ROWS, _i64, _i64, _i64, _i64, _int, _i64],
    "tf_mamba2_scan": [_ptr, _ptr, _ptr, _ptr, _ptr, _int, _ptr, _int, _int, _ptr, _ptr, _int, _f32, _f32, _ptr]
    + [*_ROWS, _i64, _i64, _i64, _i64, _int, _i64],
}


def compile_flags() -> list[str]:
    flags = cpu_native.cpu_flags()
    return BASE_FLAGS + [option for flag, option in WIDEST if flag in flags][:1]


@functools.cache
def source_digest() -> str:
    """The source and its compile flags: what decides the bits the recurrences compute."""
    return hashlib.sha256(SOURCE.read_bytes() + " ".join(compile_flags()).encode()).hexdigest()[:16]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (the reason is logged once)."""
    target = cpu_native.cache_dir() / f"tensorfold_recurrent-{source_digest()}.so"
    try:
        if not target.exists():
            cpu_native.build(target, [SOURCE], compile_flags())
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("native recurrent kernels off: building them failed: %s", getattr(exc, "stderr", "") or exc)
        return None
    for name, argtypes in SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
    return lib


def available() -> bool:
    """Whether the CPU path runs these kernels (`TENSORFOLD_KERNELS=torch` keeps torch's)."""
    if os.environ.get("TENSORFOLD_KERNELS", "auto").strip().lower() == "torch":
        return False
    return library() is not None


def supports(*tensors: torch.Tensor | None) -> bool:
    """CPU tensors of float32 / bfloat16, with the kernels built."""
    present = [t for t in tensors if t is not None]
    return all(t.device.type == "cpu" and t.dtype in DTYPE_CODES for t in present) and available()


@functools.lru_cache(maxsize=4)
def row_arrays(rows: ScanRows) -> "RowArrays":
    """One step's RowArrays, built once for all its recurrent layers (ScanRows is a value)."""
    return RowArrays(rows)


class RowArrays:
    """ScanRows as the C side reads them: int64 arrays, captures grouped by sequence and sorted by row."""

    def __init__(self, rows: ScanRows) -> None:
        spans = zip(rows.starts, rows.ends)
        groups = [sorted((row, slot) for row, slot in rows.captures if lo <= row < hi) for lo, hi in spans]
        flat = [pair for group in groups for pair in group]
        begin = [0]
        for group in groups:
            begin.append(begin[-1] + len(group))
        self.count = len(rows.starts)
        self.tensors = [
            torch.tensor(values, dtype=torch.int64)
            for values in (rows.starts, rows.ends, rows.slots, begin, [r for r, _ in flat], [s for _, s in flat])
        ]

    def pointers(self) -> list[int]:
        return [t.data_ptr() for t in self.tensors]


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [T, C] with contiguous rows (a column slice of a wider output keeps its stride)."""
    return x if x.dim() == 2 and x.stride(1) == 1 else x.contiguous()


def causal_conv_scan(
    x: torch.Tensor, history_pool: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: ScanRows
) -> torch.Tensor:
    """recurrent_scan.causal_conv_scan: x [T, C], history_pool [S, K - 1, C], weight [C, K] and bias [C]
    all of one dtype -> [T, C] float32 (torch's bits)."""
    lib = library()
    assert lib is not None
    x, weight = _rows_contiguous(x), weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    out = torch.empty(x.shape, dtype=torch.float32)
    arrays = row_arrays(rows)
    lib.tf_causal_conv_scan(
        x.data_ptr(),
        x.stride(0),
        history_pool.data_ptr(),
        weight.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        *arrays.pointers(),
        arrays.count,
        x.shape[1],
        weight.shape[1],
        DTYPE_CODES[x.dtype],
        cpu_native.threads(),
        PARALLEL_WORK,
    )
    return out


def conv_supported(
    x: torch.Tensor, history_pool: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> bool:
    """One dtype throughout, matching shapes and a contiguous pool (advanced in place)."""
    if weight.dim() != 2:
        return False
    same = all(t.dtype == x.dtype for t in (history_pool, weight) + ((bias,) if bias is not None else ()))
    channels, kernel = weight.shape
    shapes = x.dim() == 2 and x.shape[1] == channels and history_pool.shape[1:] == (kernel - 1, channels)
    shapes = shapes and (bias is None or bias.shape == (channels,))
    return same and shapes and history_pool.is_contiguous() and supports(x, history_pool, weight, bias)


def gated_delta_scan(
    state_pool: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    beta: torch.Tensor,
    neg_a: torch.Tensor,
    dt_bias: torch.Tensor,
    rows: ScanRows,
) -> torch.Tensor:
    """recurrent_scan.gated_delta_scan: o [T, Hv, Dv] float32."""
    lib = library()
    assert lib is not None
    q, k, v, beta, neg_a = (t.contiguous() for t in (q, k, v, beta, neg_a))
    a, dt_bias = a.contiguous(), dt_bias.contiguous()
    out = torch.empty(v.shape, dtype=torch.float32)
    arrays = row_arrays(rows)
    heads, dk, dv = state_pool.shape[1:]
    lib.tf_gated_delta_scan(
        state_pool.data_ptr(),
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        a.data_ptr(),
        DTYPE_CODES[a.dtype],
        beta.data_ptr(),
        neg_a.data_ptr(),
        dt_bias.data_ptr(),
        DTYPE_CODES[dt_bias.dtype],
        out.data_ptr(),
        *arrays.pointers(),
        arrays.count,
        heads,
        dk,
        dv,
        cpu_native.threads(),
        PARALLEL_WORK,
    )
    return out


def gated_delta_supported(state_pool: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """A contiguous float32 pool; q, k, v, beta and neg_a float32 (a and dt_bias float32 or bfloat16); the
    pool's heads and sizes throughout."""
    q, k, v, a, beta, neg_a, dt_bias = tensors
    floats = all(t.dtype == torch.float32 for t in (state_pool, q, k, v, beta, neg_a))
    _, heads, dk, dv = state_pool.shape
    tokens = q.shape[0]
    shapes = q.shape == k.shape == (tokens, heads, dk) and v.shape == (tokens, heads, dv)
    shapes = shapes and a.shape == beta.shape == (tokens, heads) and neg_a.shape == dt_bias.shape == (heads,)
    return floats and shapes and state_pool.is_contiguous() and supports(state_pool, *tensors)


def kda_scan(
    state_pool: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    rows: ScanRows,
) -> torch.Tensor:
    """recurrent_scan.kda_scan: o [T, H, Dv] float32."""
    lib = library()
    assert lib is not None
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    out = torch.empty(v.shape, dtype=torch.float32)
    arrays = row_arrays(rows)
    heads, dk, dv = state_pool.shape[1:]
    lib.tf_kda_scan(
        state_pool.data_ptr(),
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        g.data_ptr(),
        beta.data_ptr(),
        out.data_ptr(),
        *arrays.pointers(),
        arrays.count,
        heads,
        dk,
        dv,
        cpu_native.threads(),
        PARALLEL_WORK,
    )
    return out


def kda_supported(state_pool: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """A contiguous float32 pool; q, k, v, g and beta float32 with the pool's heads and sizes."""
    q, k, v, g, beta = tensors
    floats = all(t.dtype == torch.float32 for t in (state_pool, *tensors))
    _, heads, dk, dv = state_pool.shape
    tokens = q.shape[0]
    shapes = q.shape == k.shape == g.shape == (tokens, heads, dk) and v.shape == (tokens, heads, dv)
    shapes = shapes and beta.shape == (tokens, heads)
    return floats and shapes and state_pool.is_contiguous() and supports(state_pool, *tensors)


def mamba2_scan(
    state_pool: torch.Tensor,
    x: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    a: torch.Tensor,
    d: torch.Tensor,
    time_step_limit: tuple[float, float],
    rows: ScanRows,
) -> torch.Tensor:
    """recurrent_scan.mamba2_scan: y [T, H, P] float32."""
    lib = library()
    assert lib is not None
    x, b, c, dt, dt_bias, a, d = (t.contiguous() for t in (x, b, c, dt, dt_bias, a, d))
    out = torch.empty(x.shape, dtype=torch.float32)
    arrays = row_arrays(rows)
    low, high = time_step_limit
    step_dtype = torch.promote_types(dt.dtype, dt_bias.dtype)  # where torch computes dt + dt_bias and softplus
    heads, head_dim, state_size = state_pool.shape[1:]
    lib.tf_mamba2_scan(
        state_pool.data_ptr(),
        x.data_ptr(),
        b.data_ptr(),
        c.data_ptr(),
        dt.data_ptr(),
        DTYPE_CODES[dt.dtype],
        dt_bias.data_ptr(),
        DTYPE_CODES[dt_bias.dtype],
        DTYPE_CODES[step_dtype],
        a.data_ptr(),
        d.data_ptr(),
        int(low > 0.0 or high != float("inf")),
        low,
        high,
        out.data_ptr(),
        *arrays.pointers(),
        arrays.count,
        heads,
        head_dim,
        state_size,
        cpu_native.threads(),
        PARALLEL_WORK,
    )
    return out


def mamba2_supported(state_pool: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """A contiguous float32 pool; x, b, c, a and d float32 (dt and dt_bias float32 or bfloat16); the pool's
    heads and sizes throughout."""
    x, b, c, dt, dt_bias, a, d = tensors
    floats = all(t.dtype == torch.float32 for t in (state_pool, x, b, c, a, d))
    _, heads, head_dim, state_size = state_pool.shape
    tokens = x.shape[0]
    shapes = x.shape == (tokens, heads, head_dim) and b.shape == c.shape == (tokens, heads, state_size)
    shapes = shapes and dt.shape == (tokens, heads) and dt_bias.shape == a.shape == d.shape == (heads,)
    return floats and shapes and state_pool.is_contiguous() and supports(state_pool, *tensors)

"""The CPU path's native kernels (kernels/cpu/*.c), compiled on first use and loaded with ctypes.

torch's CPU kernels either change a row's bits with the row count (float32 GEMMs, oneDNN's packed bf16
GEMMs at large K) or run far below memory bandwidth at decode shapes; these kernels do neither
(cpu_gemm.py, cpu_attention.py say how). The sources are compiled with the system C compiler into
`TENSORFOLD_KERNEL_CACHE` (default `~/.cache/tensorfold/kernels`), keyed by their hash. Without the CPU
features, a compiler, or with `TENSORFOLD_KERNELS=torch`, `available()` is False and callers keep torch.
"""

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "cpu" / name for name in ("amx_gemm.c", "paged_attention.c", "layer_ops.c")]
HEADERS = [Path(__file__).parent / "cpu" / "simd.h"]
CPU_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512bw", "avx512vl", "f16c")
# -ffp-contract=off: a multiply and an add stay two roundings, as torch computes them (never fused by the compiler).
COMPILE_FLAGS = [
    "-O3",
    "-shared",
    "-fPIC",
    "-fopenmp",
    "-ffp-contract=off",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
    "-mf16c",
    "-mamx-tile",
    "-mamx-bf16",
]

_ptr, _i64, _int, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "tf_amx_pack": [_ptr, _i64, _i64, _i64, _ptr],
    "tf_amx_unpack_rows": [_ptr, _i64, _i64, _ptr, _i64, _ptr],
    "tf_amx_gemm": [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _int],
    "tf_paged_attention": [
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        _i64,
        _i64,
        _i64,
        _i64,
        _i64,
        _i64,
        _i64,
        _f32,
        _int,
        _int,
    ],
    "tf_rms_norm": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32, _int, _int],
    "tf_rotary": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _int, _int],
    "tf_silu_mul": [_ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int],
    "tf_argmax_rows": [_ptr, _i64, _i64, _ptr, _int],
}


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "tensorfold" / "kernels"
    return Path(os.environ.get("TENSORFOLD_KERNEL_CACHE") or default)


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def build(target: Path, sources: list[Path], flags: list[str]) -> None:
    """Compile `sources` to `target` atomically (another process may be building the same file)."""
    compiler = os.environ.get("CC", "cc")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as scratch:
        partial = Path(scratch.name)
    try:
        command = [compiler, *flags, "-o", str(partial), *map(str, sources)]
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)


@functools.cache
def source_digest() -> str:
    """The kernels' sources and compile flags: what decides the bits they compute."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in [*SOURCES, *HEADERS]) + " ".join(COMPILE_FLAGS).encode())
    return digest.hexdigest()[:16]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels with AMX enabled for this process, or None (the reason is logged once)."""
    missing = [flag for flag in CPU_FLAGS if flag not in cpu_flags()]
    if missing:
        log.info("native CPU kernels off: this CPU lacks %s", ", ".join(missing))
        return None
    target = cache_dir() / f"tensorfold_cpu-{source_digest()}.so"
    try:
        if not target.exists():
            build(target, SOURCES, COMPILE_FLAGS)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("native CPU kernels off: building them failed: %s", getattr(exc, "stderr", "") or exc)
        return None
    if lib.tf_amx_init() != 0:
        log.warning("native CPU kernels off: the OS refused this process the AMX tile state")
        return None
    for name, argtypes in SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
    return lib


def available() -> bool:
    """Whether the CPU path runs these kernels (`TENSORFOLD_KERNELS=torch` keeps torch's)."""
    if os.environ.get("TENSORFOLD_KERNELS", "auto").strip().lower() == "torch":
        return False
    return library() is not None


def threads() -> int:
    """The intra-op thread count torch uses, which these kernels follow."""
    import torch

    return torch.get_num_threads()

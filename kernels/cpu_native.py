"""The CPU path's native kernels (kernels/cpu/*.c), compiled on first use and loaded with ctypes.

torch's CPU kernels either change a row's bits with the row count (float32 GEMMs, oneDNN's packed bf16
GEMMs at large K) or run far below memory bandwidth at decode shapes; these kernels do neither
(cpu_gemm.py, cpu_attention.py say how). They come in levels chosen at load by the CPU's features: `amx`
(the bf16 GEMM on AMX tiles) and `avx512` (AVX-512 BF16 without AMX: the same attention and layer ops, the
GEMM on VDPBF16PS) and `avx2` (AVX2 + FMA + F16C: the same sources through simd.h's portable backend, the
GEMM with bfloat16 widened to fp32 and FMA) on x86, and `neon` on aarch64 (ARMv8-A Advanced SIMD: the avx2
level's sources through the same portable backend, 4-float vectors); `TENSORFOLD_KERNELS=amx|avx512|avx2|neon`
forces one, `auto` takes the best the CPU has (read from /proc/cpuinfo: x86's `flags`, aarch64's `Features`). The
sources are compiled with the system C compiler into `TENSORFOLD_KERNEL_CACHE` (default
`~/.cache/tensorfold/kernels`), keyed by level and hash. Without the CPU features, a compiler, or with
`TENSORFOLD_KERNELS=torch`, `available()` is False and callers keep torch.
"""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CPU_DIR = Path(__file__).parent / "cpu"
HEADERS = [
    CPU_DIR / name
    for name in (
        "simd.h",
        "simd_avx512.h",
        "simd_portable.h",
        "bf16_pack.h",
        "pair_pack.h",
        "pair_gemm.h",
        "quant_blocks.h",
        "quant_dot.h",
        "quant_tile_avx512.h",
        "quant_tile32_avx512.h",
        "quant_tile32_avx2.h",
        "quant_tile_avx2.h",
    )
]
SHARED_SOURCES = ("paged_attention.c", "layer_ops.c", "keyed_draw.c", "quant_gemm.c", "hyper_mix.c")
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "f16c")
# -ffp-contract=off: a multiply and an add stay two roundings, as torch computes them (never fused by the compiler).
BASE_COMPILE_FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off")
AVX512_COMPILE_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mf16c")
AVX2_FLAGS = ("avx2", "fma", "f16c")
AVX2_COMPILE_FLAGS = ("-mavx2", "-mfma", "-mf16c")
NEON_FLAGS = ("asimd",)  # aarch64's name for NEON; SVE CPUs have it too (there is no SVE build)


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: each level is one module constant
class Level:
    """One build of the native kernels, for one class of CPU (each computes its own GEMM bits)."""

    name: str  # what `TENSORFOLD_KERNELS` names to force it, and the cache file's prefix
    cpu_flags: tuple[str, ...]  # /proc/cpuinfo flags the CPU must have
    gemm_source: str  # the bf16 GEMM (kernels/cpu/*.c); the other sources are SHARED_SOURCES
    compile_flags: tuple[str, ...]  # the compiler's flags, BASE_COMPILE_FLAGS included

    @property
    def sources(self) -> list[Path]:
        return [CPU_DIR / name for name in (self.gemm_source, *SHARED_SOURCES)]


AMX = Level(
    "amx",
    ("amx_bf16", "amx_tile", *AVX512_FLAGS),
    "amx_gemm.c",
    (*BASE_COMPILE_FLAGS, *AVX512_COMPILE_FLAGS, "-mamx-tile", "-mamx-bf16"),
)
AVX512 = Level("avx512", AVX512_FLAGS, "avx512_gemm.c", (*BASE_COMPILE_FLAGS, *AVX512_COMPILE_FLAGS))
AVX2 = Level("avx2", AVX2_FLAGS, "fma_gemm.c", (*BASE_COMPILE_FLAGS, *AVX2_COMPILE_FLAGS))
NEON = Level("neon", NEON_FLAGS, "fma_gemm.c", BASE_COMPILE_FLAGS)  # NEON is part of the aarch64 baseline
LEVELS = (AMX, AVX512, AVX2, NEON)  # best first: `auto` takes the first this CPU has

_ptr, _i64, _int, _f32, _f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_double
SIGNATURES = {
    "tf_bf16_pack": [_ptr, _i64, _i64, _i64, _ptr],
    "tf_bf16_unpack_rows": [_ptr, _i64, _i64, _ptr, _i64, _ptr],
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
        _i64,
        _f32,
        _int,
        _int,
    ],
    "tf_rms_norm": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32, _int, _int],
    "tf_rotary": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _int, _int],
    "tf_silu_mul": [_ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int],
    "tf_gelu_tanh_mul": [_ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int],
    "tf_rms_norm_wide": [_ptr, _ptr, _ptr, _i64, _i64, _f32, _int, _int],
    "tf_argmax_rows": [_ptr, _i64, _i64, _ptr, _int],
    "tf_hyper_weights": [_ptr, _ptr, _ptr, _i64, _int, _int, _f32, _ptr, _ptr, _ptr, _int],
    "tf_hyper_collapse": [_ptr, _ptr, _ptr, _i64, _int, _i64, _int, _int],
    "tf_hyper_merge": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _int, _i64, _int, _int],
    "tf_rank_head": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _int],
    "tf_keyed_draw": [_ptr, _i64, _i64, _ptr, _int, _ptr, _ptr, _int],
    "tf_keyed_masses": [_ptr, _i64, _f32, _f64, _int, _ptr, _ptr],
    "tf_quant_matmul": [_ptr, _i64, _i64, _ptr, _i64, _int, _ptr, _int, _int],
    "tf_quant_dequantize": [_ptr, _i64, _int, _ptr, _i64, _ptr, _int],
}
GEMM_SIGNATURES = {
    "amx": ("tf_amx_gemm", [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _int]),
    "avx512": ("tf_avx512_gemm", [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _int]),
    "avx2": ("tf_fma_gemm", [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _int]),
    "neon": ("tf_fma_gemm", [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _int]),
}


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "tensorfold" / "kernels"
    return Path(os.environ.get("TENSORFOLD_KERNEL_CACHE") or default)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where it cannot be read and the machine is not aarch64)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        text = ""
    return parse_cpu_flags(text, platform.machine())


def parse_cpu_flags(cpuinfo: str, machine: str) -> frozenset[str]:
    """The feature flags in /proc/cpuinfo's text: x86's `flags` line or aarch64's `Features` line. An aarch64
    machine whose text has neither (some containers hide it) still has NEON, which ARMv8-A requires."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset(NEON_FLAGS) if machine.lower() in ("aarch64", "arm64") else frozenset()


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


# level()'s answers by (TENSORFOLD_KERNELS, the flags reader): the layers ask several times per layer and
# step, and choosing again each time cost more than the kernels at decode shapes.
_LEVELS: dict[tuple[str | None, object], Level | None] = {}


def level() -> Level | None:
    """The level this process runs: `TENSORFOLD_KERNELS` names one (`torch`: none), else the best the CPU has."""
    key = (os.environ.get("TENSORFOLD_KERNELS"), cpu_flags)
    if key not in _LEVELS:
        _LEVELS[key] = _choose(key[0])
    return _LEVELS[key]


def _choose(setting: str | None) -> Level | None:
    requested = (setting or "auto").strip().lower() or "auto"
    if requested == "torch":
        return None
    candidates = [lv for lv in LEVELS if lv.name == requested] or list(LEVELS)
    for candidate in candidates:
        if candidate in supported_levels():
            return candidate
    _log_missing(candidates[-1])
    return None


def supported_levels() -> list[Level]:
    """The levels this CPU's features allow, best first."""
    return [lv for lv in LEVELS if all(flag in cpu_flags() for flag in lv.cpu_flags)]


@functools.cache
def _log_missing(chosen: Level) -> None:
    missing = [flag for flag in chosen.cpu_flags if flag not in cpu_flags()]
    log.info("native CPU kernels off: this CPU lacks %s", ", ".join(missing))


def source_digest() -> str:
    """The running level's sources and compile flags: what decides the bits its kernels compute."""
    chosen = level()
    return _digest(chosen) if chosen is not None else "torch-kernels"


@functools.cache
def _digest(chosen: Level) -> str:
    parts = [p.read_bytes() for p in [*chosen.sources, *HEADERS]]
    digest = hashlib.sha256(b"".join(parts) + " ".join(chosen.compile_flags).encode())
    return f"{chosen.name}-{digest.hexdigest()[:16]}"


def library() -> ctypes.CDLL | None:
    """The compiled kernels of this process's level, or None (the reason is logged once)."""
    chosen = level()
    return _load(chosen) if chosen is not None else None


@functools.cache
def _load(chosen: Level) -> ctypes.CDLL | None:
    target = cache_dir() / f"tensorfold_cpu-{_digest(chosen)}.so"
    try:
        if not target.exists():
            build(target, list(chosen.sources), list(chosen.compile_flags))
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("native CPU kernels off: building them failed: %s", getattr(exc, "stderr", "") or exc)
        return None
    if chosen is AMX and lib.tf_amx_init() != 0:
        log.warning("native CPU kernels off: the OS refused this process the AMX tile state")
        return None
    gemm, gemm_args = GEMM_SIGNATURES[chosen.name]
    for name, argtypes in {**SIGNATURES, gemm: gemm_args}.items():
        getattr(lib, name).argtypes = argtypes
    log.info("native CPU kernels: the %s level", chosen.name)
    return lib


def available() -> bool:
    """Whether the CPU path runs these kernels (`TENSORFOLD_KERNELS=torch` keeps torch's)."""
    return library() is not None


def level_name() -> str:
    """What the CPU path runs, as benchmarks print it: the native level's name, or "torch"."""
    chosen = level()
    return chosen.name if chosen is not None and available() else "torch"


def threads() -> int:
    """The intra-op thread count torch uses, which these kernels follow."""
    import torch

    return torch.get_num_threads()

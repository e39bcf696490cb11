"""The portable native kernels as C programs (tests/kernels/native/kernels_check.c): the avx2 level built
natively, and ARM NEON built from the same sources with a cross compiler and run under qemu-aarch64 (or
natively on an ARM machine). Each build checks the GEMM is the fp32 sum in K order rounded once, attention
and the layer ops near float64 references or exact, and every row's bits the same at any row count and on
1 or 2 threads.

The NEON build skips only where neither an ARM CPU nor the cross toolchain (gcc-aarch64-linux-gnu,
qemu-user; .ci/run installs them) is present. The `neon` level's shared library, as kernels/cpu_native.py
builds it on an aarch64 machine, is cross-compiled here too and must export every function Python binds.
"""

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from kernels import cpu_native

CHECK = Path(__file__).parent / "native" / "kernels_check.c"
SOURCES = [cpu_native.CPU_DIR / name for name in ("fma_gemm.c", "paged_attention.c", "layer_ops.c")]
CHECKS = (
    "gemm_is_the_fp32_sum_in_k_order",
    "gemm_rows_invariant",
    "attention_near_float64",
    "attention_rows_invariant",
    "rms_norm_near_float64",
    "rotary_exact",
    "silu_mul_bf16_near_libm",
    "argmax_exact",
    "sum_lanes_is_reduce_add_per_lane",
)
# The levels' optimisation and rounding flags (a program, not a shared library).
PROGRAM_FLAGS = [flag for flag in cpu_native.BASE_COMPILE_FLAGS if flag not in ("-shared", "-fPIC")]


def _build(name: str) -> tuple[list[str], list[str]] | None:
    """(the compile command's head, the run command's head) for this build here, or None if it cannot run."""
    if name == "avx2":
        if platform.machine() not in ("x86_64", "AMD64") or not all(
            f in cpu_native.cpu_flags() for f in cpu_native.AVX2_FLAGS
        ):
            return None
        return ["cc", *PROGRAM_FLAGS, *cpu_native.AVX2_COMPILE_FLAGS], []
    if platform.machine() in ("aarch64", "arm64"):
        return ["cc", *PROGRAM_FLAGS], []
    if shutil.which("aarch64-linux-gnu-gcc") and shutil.which("qemu-aarch64"):
        return ["aarch64-linux-gnu-gcc", *PROGRAM_FLAGS, "-march=armv8-a", "-static"], [shutil.which("qemu-aarch64")]
    return None


def _compile_and_run(
    build: tuple[list[str], list[str]], program: Path, sources: list[str]
) -> subprocess.CompletedProcess[str]:
    """Compile `sources` into `program` with this build's compiler and run it (under qemu for NEON), 2 threads."""
    compile_head, run_head = build
    command = [*compile_head, f"-I{cpu_native.CPU_DIR}", "-o", str(program), *sources, "-lm"]
    subprocess.run(command, check=True, capture_output=True, timeout=240)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    return subprocess.run([*run_head, str(program)], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("name", ["avx2", "neon"])
def test_the_portable_kernels_pass_their_c_checks(name: str, tmp_path: Path) -> None:
    build = _build(name)
    if build is None:
        pytest.skip(f"no {name} build here (neon: an ARM CPU, or gcc-aarch64-linux-gnu and qemu-user)")
    result = _compile_and_run(build, tmp_path / f"kernels_check_{name}", [*map(str, SOURCES), str(CHECK)])
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stdout + result.stderr
    assert lines == [f"ok {check}" for check in CHECKS]


def test_the_neon_level_builds_as_python_loads_it(monkeypatch, tmp_path: Path) -> None:
    """kernels/cpu_native.py's `neon` level (its sources and flags) cross-compiled to an aarch64 shared library
    that exports every symbol the ctypes bindings name (loading it needs an ARM CPU; its code runs above)."""
    compiler = shutil.which("aarch64-linux-gnu-gcc") if platform.machine() not in ("aarch64", "arm64") else "cc"
    nm = shutil.which("aarch64-linux-gnu-nm") if compiler != "cc" else shutil.which("nm")
    if compiler is None or nm is None:
        pytest.skip("no aarch64 compiler here (gcc-aarch64-linux-gnu)")
    target = tmp_path / "tensorfold_cpu-neon.so"
    level = cpu_native.NEON
    monkeypatch.setenv("CC", compiler)  # what build() compiles with
    cpu_native.build(target, level.sources, list(level.compile_flags))
    symbols = subprocess.run([nm, "-D", "--defined-only", str(target)], check=True, capture_output=True, text=True)
    exported = {line.split()[-1] for line in symbols.stdout.splitlines() if line.strip()}
    gemm, _ = cpu_native.GEMM_SIGNATURES[level.name]
    assert {*cpu_native.SIGNATURES, gemm, "tf_bf16_pack"} <= exported


QUANT_CHECK = Path(__file__).parent / "native" / "quant_check.c"
QUANT_CHECKS = [
    f"ok {check}_{qtype}"
    for qtype in ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k")
    for check in ("simd_is_portable", "rows_invariant", "near_float64")
]


@pytest.mark.parametrize("name", ["avx2", "neon"])
def test_the_quantized_gemm_passes_its_c_checks(name: str, tmp_path: Path) -> None:
    """kernels/cpu/quant_gemm.c's SIMD path (AVX2, or NEON's widening multiplies) equal to its portable C."""
    build = _build(name)
    if build is None:
        pytest.skip(f"no {name} build here (neon: an ARM CPU, or gcc-aarch64-linux-gnu and qemu-user)")
    sources = [str(cpu_native.CPU_DIR / "quant_gemm.c"), str(QUANT_CHECK)]
    result = _compile_and_run(build, tmp_path / f"quant_check_{name}", sources)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == QUANT_CHECKS

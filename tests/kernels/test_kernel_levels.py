"""The native kernels' levels (kernels/cpu_native.py): which one a CPU and `TENSORFOLD_KERNELS` pick, and
that each has its own build identity (they compute different GEMM bits)."""

from pathlib import Path

import pytest

from kernels import cpu_native, dispatch


@pytest.fixture
def cpu_has(monkeypatch):
    """Pretend the CPU has exactly these /proc/cpuinfo flags."""

    def set_flags(*flags: str) -> None:
        monkeypatch.setattr(cpu_native, "cpu_flags", lambda: frozenset(flags))

    return set_flags


AMX_CPU = ("amx_bf16", "amx_tile", *cpu_native.AVX512_FLAGS, *cpu_native.AVX2_FLAGS)


@pytest.mark.parametrize(
    "flags,requested,expected",
    [
        (AMX_CPU, "auto", "amx"),
        (AMX_CPU, "avx512", "avx512"),
        (AMX_CPU, "triton", "amx"),
        (cpu_native.AVX512_FLAGS, "auto", "avx512"),
        (cpu_native.AVX512_FLAGS, "amx", None),  # a forced level the CPU lacks: torch
        (cpu_native.AVX512_FLAGS[:-1], "auto", None),  # no f16c
        (AMX_CPU, "torch", None),
        (AMX_CPU, "avx2", "avx2"),  # an AMX machine runs every level
        (cpu_native.AVX512_FLAGS, "avx2", None),  # AVX-512 without the avx2/fma flags
        ((*cpu_native.AVX512_FLAGS, *cpu_native.AVX2_FLAGS), "avx2", "avx2"),
        (cpu_native.AVX2_FLAGS, "auto", "avx2"),  # an AVX2 CPU without AVX-512
        (cpu_native.AVX2_FLAGS, "avx512", None),
        (cpu_native.AVX2_FLAGS[1:], "auto", None),  # no avx2
        (cpu_native.NEON_FLAGS, "auto", "neon"),
        (cpu_native.NEON_FLAGS, "avx2", None),  # an x86 level on ARM: torch
        (AMX_CPU, "neon", None),  # and the ARM level on x86
    ],
)
def test_the_level_follows_the_cpu_and_the_setting(cpu_has, monkeypatch, flags, requested, expected) -> None:
    cpu_has(*flags)
    monkeypatch.setenv("TENSORFOLD_KERNELS", requested)
    chosen = cpu_native.level()
    assert (chosen.name if chosen else None) == expected
    assert dispatch.mode() == requested


CPUINFO = Path(__file__).parent / "cpuinfo"  # one processor's block of /proc/cpuinfo from each kind of CPU


@pytest.mark.parametrize(
    "cpuinfo,machine,expected",
    [
        ("x86_amx.txt", "x86_64", ["amx", "avx512", "avx2"]),  # Sapphire Rapids
        ("x86_avx512.txt", "x86_64", ["avx512", "avx2"]),  # Zen 4: AVX-512 BF16, no AMX
        ("x86_avx2.txt", "x86_64", ["avx2"]),  # Zen 2
        ("aarch64_neon.txt", "aarch64", ["neon"]),  # Neoverse N1
        ("aarch64_sve.txt", "aarch64", ["neon"]),  # Neoverse V1: SVE runs the NEON build
    ],
)
def test_the_levels_follow_recorded_cpuinfo(monkeypatch, cpuinfo: str, machine: str, expected: list[str]) -> None:
    flags = cpu_native.parse_cpu_flags((CPUINFO / cpuinfo).read_text(encoding="utf-8"), machine)
    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: flags)
    assert [level.name for level in cpu_native.supported_levels()] == expected
    monkeypatch.setenv("TENSORFOLD_KERNELS", "auto")
    assert cpu_native.level().name == expected[0]


def test_aarch64_without_a_features_line_still_has_neon() -> None:
    assert cpu_native.parse_cpu_flags("processor\t: 0\n", "aarch64") == {"asimd"}
    assert cpu_native.parse_cpu_flags("processor\t: 0\n", "x86_64") == frozenset()


def test_each_level_has_its_own_build_identity(cpu_has, monkeypatch) -> None:
    cpu_has(*AMX_CPU)
    digests = {}
    for requested in ("amx", "avx512", "avx2", "torch"):
        monkeypatch.setenv("TENSORFOLD_KERNELS", requested)
        digests[requested] = cpu_native.source_digest()
    cpu_has(*cpu_native.NEON_FLAGS)
    monkeypatch.setenv("TENSORFOLD_KERNELS", "neon")
    digests["neon"] = cpu_native.source_digest()  # avx2's sources, its own flags
    assert all(digests[name].startswith(f"{name}-") for name in ("amx", "avx512", "avx2", "neon"))
    assert len(set(digests.values())) == 5


def test_the_avx512_level_leaves_out_amx() -> None:
    assert not any("amx" in flag for flag in (*cpu_native.AVX512.cpu_flags, *cpu_native.AVX512.compile_flags))
    assert cpu_native.AMX.sources[1:] == cpu_native.AVX512.sources[1:]  # attention and layer ops: one source
    assert cpu_native.AVX2.sources[1:] == cpu_native.AVX512.sources[1:]


def test_the_avx2_level_leaves_out_avx512() -> None:
    assert not any("avx512" in flag or "amx" in flag for flag in cpu_native.AVX2.compile_flags)
    assert set(cpu_native.AVX2.cpu_flags) == {"avx2", "fma", "f16c"}


@pytest.mark.parametrize("name", ["avx512", "avx2"])
def test_each_level_this_cpu_has_builds_and_runs_here(monkeypatch, name: str) -> None:
    import torch

    from kernels import cpu_gemm

    chosen = next(lv for lv in cpu_native.LEVELS if lv.name == name)
    if chosen not in cpu_native.supported_levels():
        pytest.skip(f"this CPU lacks {', '.join(chosen.cpu_flags)}")
    monkeypatch.setenv("TENSORFOLD_KERNELS", name)
    assert cpu_native.available() and cpu_native.level_name() == name
    weight = torch.randn(64, 64).to(torch.bfloat16)
    pack = weight.clone()
    cpu_gemm.pack_(pack)
    x = torch.randn(3, 64).to(torch.bfloat16)
    reference = x.double() @ weight.double().T
    assert (cpu_gemm.matmul(x, pack).double() - reference).abs().max() <= 0.01 * reference.abs().max()


def test_benchmarks_name_the_level_that_runs(monkeypatch) -> None:
    monkeypatch.setenv("TENSORFOLD_KERNELS", "torch")
    assert cpu_native.level_name() == "torch"
    monkeypatch.setenv("TENSORFOLD_KERNELS", "auto")
    chosen = cpu_native.level()
    assert cpu_native.level_name() == (chosen.name if chosen is not None and cpu_native.available() else "torch")

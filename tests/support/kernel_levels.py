"""The CPU kernel levels the bf16 exactness tests run at besides the default: each native level this CPU
has below the one `auto` picks, then torch's kernels (`TENSORFOLD_KERNELS=torch`), so a machine with
AVX-512 or AMX also proves the levels a smaller CPU would run (docs/engine.md, "CPU kernel levels")."""

from kernels import cpu_native


def other_kernel_levels() -> list[str]:
    """`TENSORFOLD_KERNELS` values to force, best first: the lower native levels this CPU runs, then torch."""
    return [level.name for level in cpu_native.supported_levels()[1:]] + ["torch"]

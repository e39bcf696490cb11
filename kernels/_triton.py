"""Triton, if importable, and the `jit` every kernel module decorates with.

Kernel modules must import on machines without Triton (their torch references are the CPU path), so a
missing Triton leaves stand-ins whose launch raises a clear error. Without CUDA, Triton kernels can only
run in Triton's interpreter, and Triton reads `TRITON_INTERPRET` once, when it is imported (its own
library functions such as `tl.zeros` are decorated then): so this module turns the interpreter on before
importing Triton on CUDA-less machines. `TRITON_INTERPRET=0` keeps compiled kernels there (ahead-of-time
compile checks).
"""

import os
from collections.abc import Callable
from typing import Any

import torch

if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the CPU path never needs it
    triton = None
    HAS_TRITON = False

    class _MissingLanguage:
        """Lets `tl.constexpr` annotations and the like evaluate when the module is imported."""

        def __getattr__(self, name: str) -> Any:
            return object

    tl = _MissingLanguage()


class _Unavailable:
    """Stands in for a kernel when Triton is not installed: launching it raises."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        raise RuntimeError(f"kernel {self.fn.__name__} needs Triton, which is not installed (pip install triton)")


def interpreting() -> bool:
    """Whether kernels run in Triton's interpreter (on CPU tensors) rather than compiled for CUDA."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def jit(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """`triton.jit` (as `@jit` or `@jit(do_not_specialize=...)`), or a stand-in that raises on launch when
    Triton is not installed."""
    if fn is None:
        return lambda inner: jit(inner, **options)
    return triton.jit(fn, **options) if HAS_TRITON else _Unavailable(fn)


def next_pow2(n: int) -> int:
    """Triton block sizes are powers of two; padded lanes are masked."""
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 dots in full precision (TF32 would miss the float32 error bound); others ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"

"""Helpers for the kernel tests: where they run, poisoned outputs, float64 references and error bounds.

The tests run under Triton's interpreter on CPU by default; `TENSORFOLD_KERNEL_TEST_DEVICE=cuda` (set by
`python -m kernels.gpu_check`) runs the same tests compiled on a GPU.
"""

import os
import zlib

import torch

# Max |out - ref| / max |ref| over the whole tensor, ref in float64 from the same (rounded) inputs.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def kernel_test_device() -> torch.device:
    """The device the kernel tests use: CPU under the interpreter unless asked (or forced) to use CUDA.

    Call it before Triton is imported: Triton reads TRITON_INTERPRET once, at import.
    """
    if os.environ.get("TENSORFOLD_KERNEL_TEST_DEVICE") == "cuda":
        return torch.device("cuda")
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language as tl
    except ImportError:
        return torch.device("cpu")  # the test module skips
    if type(tl.zeros).__name__ != "InterpretedFunction":  # Triton was imported before the flag was set
        if torch.cuda.is_available():  # then it was imported compiled: test on the GPU
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous
            return torch.device("cuda")
        raise RuntimeError("Triton was imported before TRITON_INTERPRET=1 was set: its interpreter cannot run")
    patch_interpreter_bf16()
    return torch.device("cpu")


def patch_interpreter_bf16() -> None:
    """Make the interpreter's `tl.dot` and bf16 casts behave as on a GPU, where the kernels rely on it.

    - The interpreter stores bfloat16 as raw uint16 bits and its `tl.dot` multiplies the bits
      (triton-lang/triton#11584; bf16 is unsupported there upstream). GPUs multiply bf16/fp16 operands
      exactly and accumulate in float32: converting the operands to float32 first reproduces that.
    - Its `tl.dot` is numpy's matmul, whose BLAS kernel (and so an element's rounding) changes with the
      number of rows and a row's place among them. A GPU's MMA computes each element the same way
      wherever its row sits, which the batch-invariance tests rely on; `einsum` (one fixed summation order
      per element) reproduces that.
    - float32 -> bfloat16 casts truncate; GPUs round to nearest even, which torch's cast reproduces.
    Kernels do no other arithmetic on bfloat16 values (they convert to float32 first).
    """
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_tensorfold_patched", False):
        return
    original_dot, original_cast = builder.create_dot, builder.cast_impl
    float_types = (tl.bfloat16, tl.float16, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        if a.dtype.scalar not in float_types or a.data.ndim != 2:
            return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        a32, b32 = original_cast(self, a, tl.float32).data, original_cast(self, b, tl.float32).data
        out = np.einsum("mk,kn->mn", a32, b32).astype(d.data.dtype) + d.data
        return interpreter.TensorHandle(out, d.dtype.scalar)

    def cast_impl(self, src, dst_type):  # type: ignore[no-untyped-def]
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.array(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return original_cast(self, src, dst_type)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl
    builder._tensorfold_patched = True


def poisoned(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer full of NaN, so an element the kernel fails to write cannot pass."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def randn(
    *shape: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator, scale: float = 1.0
) -> torch.Tensor:
    """Fresh normal values (never zeros), drawn on CPU from `gen` so each case is reproducible."""
    return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).to(dtype=dtype, device=device)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.double().cpu() - ref.double().cpu()).abs().max().item()
    return diff / max(ref.double().abs().max().item(), 1e-30)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "output") -> None:
    """Every element written and finite, and the whole tensor within the dtype's relative bound."""
    if out.shape != ref.shape:
        raise AssertionError(f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    bad = ~torch.isfinite(out.double().cpu())
    if bad.any():
        first = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(bad.sum())} elements not finite (first at {first}): unwritten or NaN")
    err = relative_error(out, ref)
    if not err < TOLERANCE[dtype]:
        raise AssertionError(f"{what}: relative error {err:.3g} >= {TOLERANCE[dtype]:.0e} for {dtype}")


def case_generator(*params: object) -> torch.Generator:
    """A generator seeded from the case's parameters: fresh inputs per case, reproducible per case."""
    return torch.Generator().manual_seed(zlib.crc32(repr(params).encode()))


def paged_tables(
    context_lens: list[int], block_size: int, gen: torch.Generator, spare: int = 2
) -> tuple[list[list[int]], int]:
    """Block tables over a shuffled pool (so neighbours in a table are not neighbours in memory), and its size."""
    needed = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(needed) + spare
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(pool[used : used + n])
        used += n
    return tables, num_blocks


def paged_cache(
    row_shape: tuple[int, ...],
    tables: list[list[int]],
    context_lens: list[int],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
) -> torch.Tensor:
    """A cache [blocks, block_size, *row_shape]: random rows at each sequence's first context_lens slots,
    NaN everywhere else, so a kernel that reads a slot outside a context cannot pass."""
    cache = torch.full((num_blocks, block_size, *row_shape), float("nan"), dtype=dtype)
    for table, length in zip(tables, context_lens):
        for pos in range(length):
            cache[table[pos // block_size], pos % block_size] = randn(
                *row_shape, dtype=dtype, device=torch.device("cpu"), gen=gen
            )
    return cache.to(device)

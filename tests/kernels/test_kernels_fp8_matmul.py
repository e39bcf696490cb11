"""The block-scaled FP8 matmul (kernels/fp8_matmul.py) under the interpreter: rows alone equal the same rows in
batches bit for bit, the result is within the dtype's bound of a float64 product of the dequantized weight,
and it equals kernels/matmul.py on the weight dequantized as the CPU load does, bit for bit."""

import pytest
import torch

from kernels.testing import assert_close, case_generator, kernel_test_device, poisoned, randn

DEVICE = kernel_test_device()  # turns the interpreter on before Triton is imported
pytest.importorskip(
    "triton", reason="Triton is not importable: kernel tests need it (pip install triton)", exc_type=ImportError
)

from kernels import fp8_matmul, matmul  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ROWS, DEPTH, COLS, SCALE_K = 70, 100, 72, 48  # K: two tiles, the last partial; scale blocks partial at 100
BATCHES = [(0, 1), (5, 3), (30, 17), (6, 64), (0, 70)]  # (first row, size): across the 64-row tile's edge


def operands(dtype: torch.dtype, *case: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [ROWS, DEPTH], an fp8 weight [COLS, DEPTH] and its per-row scales [COLS, ceil(DEPTH / SCALE_K)]."""
    gen = case_generator("fp8_matmul", dtype, *case)
    x = randn(ROWS, DEPTH, dtype=dtype, device=DEVICE, gen=gen)
    weight = (randn(COLS, DEPTH, dtype=torch.float32, device=DEVICE, gen=gen) * 100).to(torch.float8_e4m3fn)
    scales = torch.rand(COLS, -(-DEPTH // SCALE_K), generator=gen).to(DEVICE) * DEPTH**-0.5 / 100 + 1e-4
    return x, weight, scales


def dequantized_float64(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return weight.double() * scales.double().repeat_interleave(SCALE_K, 1)[:, :DEPTH]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_alone_equal_the_same_rows_in_batches_and_match_float64(dtype):
    x, weight, scales = operands(dtype, "invariance")
    whole = fp8_matmul.fp8_matmul(x, weight, scales, SCALE_K, out=poisoned(ROWS, COLS, dtype=dtype, device=DEVICE))
    for start, size in BATCHES:
        batched = fp8_matmul.fp8_matmul(x[start : start + size], weight, scales, SCALE_K)
        assert torch.equal(batched, whole[start : start + size]), f"batch of {size} from row {start}"
    assert whole.dtype == dtype
    assert_close(whole, x.double() @ dequantized_float64(weight, scales).T, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_equals_the_matmul_of_the_weight_the_cpu_load_dequantizes(dtype):
    x, weight, scales = operands(dtype, "dequantized")
    dequantized = (weight.float() * scales.repeat_interleave(SCALE_K, 1)[:, :DEPTH]).to(dtype)
    assert torch.equal(fp8_matmul.fp8_matmul(x, weight, scales, SCALE_K), matmul.invariant_matmul(x, dequantized))


def test_a_scale_grid_of_the_wrong_width_is_refused():
    x, weight, scales = operands(torch.float32, "refusal")
    with pytest.raises(ValueError, match="column blocks"):
        fp8_matmul.fp8_matmul(x, weight, scales[:, :1], SCALE_K)

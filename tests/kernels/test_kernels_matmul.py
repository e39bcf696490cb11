"""The projections' batch-invariant matmul (kernels/matmul.py) under the interpreter: a row's bits are the same
alone and in batches of any size at any place, and every output is within the dtype's bound of float64."""

import pytest
import torch

from kernels.testing import assert_close, case_generator, kernel_test_device, poisoned, randn

DEVICE = kernel_test_device()  # turns the interpreter on before Triton is imported
pytest.importorskip(
    "triton", reason="Triton is not importable: kernel tests need it (pip install triton)", exc_type=ImportError
)

from kernels import matmul  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ROWS, DEPTH, COLS = 300, 200, 72  # K spans four K tiles (the last partial), N two N tiles (the last partial)
BATCH_SIZES = [2, 3, 17, 64, 65, 130, 300]  # across 2..300, at and past the row tile's edge (BLOCK_M 64)
ALONE = [0, 1, 37, 63, 64, 65, 127, 128, 200, 255, 256, 299]  # rows run alone: tile edges and between them


def operands(dtype: torch.dtype, *case: object) -> tuple[torch.Tensor, torch.Tensor]:
    gen = case_generator("matmul", dtype, *case)
    x = randn(ROWS, DEPTH, dtype=dtype, device=DEVICE, gen=gen)
    weight = randn(COLS, DEPTH, dtype=dtype, device=DEVICE, gen=gen, scale=DEPTH**-0.5)
    return x, weight


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_alone_equal_the_same_rows_in_batches_of_2_to_300_bit_for_bit(dtype):
    x, weight = operands(dtype, "invariance")
    whole = matmul.invariant_matmul(x, weight)  # the batch of 300
    for index, size in enumerate(BATCH_SIZES):
        start = (97 * index) % (ROWS - size + 1)  # each batch at another offset: rows change places in a tile
        batched = matmul.invariant_matmul(x[start : start + size], weight)
        assert torch.equal(batched, whole[start : start + size]), f"batch of {size} from row {start}"
    for row in ALONE:
        assert torch.equal(matmul.invariant_matmul(x[row : row + 1], weight), whole[row : row + 1]), f"row {row}"
    assert_close(whole, x.double() @ weight.double().T, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 70])
def test_matches_a_float64_reference(dtype, rows):
    x, weight = operands(dtype, "reference", rows)
    out = matmul.invariant_matmul(x[:rows], weight, out=poisoned(rows, COLS, dtype=dtype, device=DEVICE))
    assert out.dtype == dtype
    assert_close(out, x[:rows].double() @ weight.double().T, dtype)


def test_strided_operands_give_the_contiguous_bits():
    """A transposed weight view and rows taken every other one read their strides, not a copy's layout."""
    x, weight = operands(torch.bfloat16, "strided")
    weight_t = weight.T.contiguous().T  # the same values, K-major
    assert weight_t.stride() != weight.stride()
    want = matmul.invariant_matmul(x[::2].contiguous(), weight)
    assert torch.equal(matmul.invariant_matmul(x[::2], weight_t), want)


def test_the_torch_path_is_the_tiled_torch_gemm():
    """Off CUDA (and with cuBLAS chosen) the projections keep torch's GEMMs on zero-padded 16-row tiles."""
    x, weight = (t.cpu() for t in operands(torch.float32, "torch path"))
    out = matmul.matmul_torch(x[:5], weight)
    padded = torch.nn.functional.pad(x[:5], (0, 0, 0, matmul.TILE_ROWS - 5))
    assert torch.equal(out, torch.nn.functional.linear(padded, weight)[:5])
    assert torch.equal(matmul.matmul_torch(x, weight)[:5], out)  # 300 rows: two calls, the same tiles


def test_empty_operands():
    x, weight = operands(torch.float32, "empty")
    assert matmul.invariant_matmul(x[:0], weight).shape == (0, COLS)
    zero_depth = matmul.invariant_matmul(x[:3, :0], weight[:, :0])
    assert torch.equal(zero_depth, torch.zeros(3, COLS, device=DEVICE))


def test_bad_operands_are_refused_before_launch():
    x, weight = operands(torch.bfloat16, "refusals")
    with pytest.raises(ValueError, match="input features"):
        matmul.invariant_matmul(x[:, :10], weight)
    with pytest.raises(TypeError, match="share one dtype"):
        matmul.invariant_matmul(x, weight.float())
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        matmul.invariant_matmul(x[0], weight)
    with pytest.raises(TypeError, match="dtype"):
        matmul.invariant_matmul(x.double(), weight.double())

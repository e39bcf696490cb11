"""RMSNorm (+ residual), rotary (full, partial, interleaved) and KV-cache writes against float64 torch."""

import pytest
import torch

from kernels.testing import assert_close, case_generator, kernel_test_device, poisoned, randn

DEVICE = kernel_test_device()  # turns the interpreter on before Triton is imported
pytest.importorskip(
    "triton", reason="Triton is not importable: kernel tests need it (pip install triton)", exc_type=ImportError
)

from kernels import kv_write, rmsnorm, rotary  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 96), (2, 3, 40)])  # one token, odd width, 3-D (per-head norm)
def test_rms_norm(dtype, shape):
    gen = case_generator("rms", dtype, shape)
    x = randn(*shape, dtype=dtype, device=DEVICE, gen=gen)
    weight = randn(shape[-1], dtype=dtype, device=DEVICE, gen=gen)
    out = rmsnorm.rms_norm(x, weight, 1e-6, out=poisoned(*shape, dtype=dtype, device=DEVICE))
    assert_close(out, rmsnorm.rms_norm_torch(x.double(), weight.double(), 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype):
    gen = case_generator("add_rms", dtype)
    x, residual = randn(5, 96, dtype=dtype, device=DEVICE, gen=gen), randn(5, 96, dtype=dtype, device=DEVICE, gen=gen)
    weight = randn(96, dtype=torch.float32, device=DEVICE, gen=gen)  # float32 weight on a bf16 stream: promotes
    out_dtype = torch.promote_types(dtype, torch.float32)
    out, summed = rmsnorm.add_rms_norm(
        x,
        residual,
        weight,
        1e-5,
        out=poisoned(5, 96, dtype=out_dtype, device=DEVICE),
        summed=poisoned(5, 96, dtype=dtype, device=DEVICE),
    )
    ref_out, ref_sum = rmsnorm.add_rms_norm_torch(x.double(), residual.double(), weight.double(), 1e-5)
    assert_close(summed, ref_sum, dtype, "x + residual")
    assert_close(out, ref_out, dtype, "normed")


def inverse_frequencies(rotary_dim: int) -> torch.Tensor:
    return (1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "head_dim, rotary_dim, interleaved, q_heads, k_heads",
    [
        (128, 128, False, 4, 4),  # full rotate-half (Llama / Qwen)
        (128, 64, False, 8, 1),  # GLM-4.5 partial_rotary_factor 0.5, GQA 8
        (64, 32, False, 4, 1),  # partial, head dim 64
        (64, 64, True, 4, 1),  # GLM-4.7-Flash MLA rope: interleaved pairs, shared single-head k
        (96, 32, True, 2, 2),  # interleaved and partial
    ],
)
def test_rotary(dtype, head_dim, rotary_dim, interleaved, q_heads, k_heads):
    gen = case_generator("rotary", dtype, head_dim, rotary_dim, interleaved, q_heads, k_heads)
    positions = torch.tensor([0, 1, 7, 300, 4095, 3, 65000], device=DEVICE)
    q = randn(7, q_heads, head_dim, dtype=dtype, device=DEVICE, gen=gen)
    k = randn(7, k_heads, head_dim, dtype=dtype, device=DEVICE, gen=gen)
    inv_freq = inverse_frequencies(rotary_dim)
    q_out, k_out = rotary.rotary(
        positions,
        q,
        k,
        inv_freq,
        1.25,
        interleaved,
        poisoned(*q.shape, dtype=dtype, device=DEVICE),
        poisoned(*k.shape, dtype=dtype, device=DEVICE),
    )
    q_ref, k_ref = rotary.rotary_torch(positions, q.double(), k.double(), inv_freq, 1.25, interleaved)
    assert_close(q_out, q_ref, dtype, "q")
    assert_close(k_out, k_ref, dtype, "k")


def test_rotary_reads_strided_views():
    """MLA rotates slices of larger projections (q[..., nope:], k[:, None, :]) without copying them."""
    gen = case_generator("rotary views")
    q_full, kv = (
        randn(3, 2, 48, dtype=torch.float32, device=DEVICE, gen=gen),
        randn(3, 80, dtype=torch.float32, device=DEVICE, gen=gen),
    )
    q_rot, k_rot = q_full[..., 32:], kv[:, 64:][:, None, :]  # [3, 2, 16], [3, 1, 16]
    positions, inv_freq = torch.tensor([5, 9, 2], device=DEVICE), inverse_frequencies(16)
    q_out, k_out = rotary.rotary(
        positions,
        q_rot,
        k_rot,
        inv_freq,
        1.0,
        True,
        poisoned(3, 2, 16, dtype=torch.float32, device=DEVICE),
        poisoned(3, 1, 16, dtype=torch.float32, device=DEVICE),
    )
    q_ref, k_ref = rotary.rotary_torch(positions, q_rot.double(), k_rot.double(), inv_freq, 1.0, True)
    assert_close(q_out, q_ref, torch.float32, "q")
    assert_close(k_out, k_ref, torch.float32, "k")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_shape", [(2, 64), (80,)])  # K/V heads, MLA latent row
def test_write_cache(dtype, row_shape):
    """Written slots hold the values, every other slot keeps its poison, a negative slot is skipped."""
    gen = case_generator("kv write", dtype, row_shape)
    cache = torch.full((6, 5, *row_shape), float("nan"), dtype=dtype, device=DEVICE)
    values = randn(5, *row_shape, dtype=torch.float32, device=DEVICE, gen=gen)  # cast to the cache dtype on store
    slots = torch.tensor([3, 29, -1, 12, 5], device=DEVICE)
    expected = cache.clone()
    kv_write.write_cache_torch(expected, values, slots)
    kv_write.write_cache(cache, values, slots)
    assert torch.equal(cache.isnan(), expected.isnan())
    assert torch.equal(cache.nan_to_num(), expected.nan_to_num())
    assert int((~cache.isnan()).sum()) == 4 * values[0].numel()


def test_wrappers_reject_bad_arguments():
    x = torch.ones(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="features"):
        rmsnorm.rms_norm(x, torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(TypeError, match="share one dtype"):
        rmsnorm.add_rms_norm(x, x.bfloat16(), torch.ones(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="exceeds head dim"):
        rotary.rotary(
            torch.zeros(2, dtype=torch.long, device=DEVICE), x[:, None], x[:, None], inverse_frequencies(16), 1.0, False
        )
    with pytest.raises(ValueError, match="do not match cache rows"):
        kv_write.write_cache(torch.zeros(2, 4, 3, device=DEVICE), x, torch.zeros(2, dtype=torch.long, device=DEVICE))

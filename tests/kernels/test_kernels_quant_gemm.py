"""The quantized-weight GEMM (kernels/quant_gemm.py over kernels/cpu/quant_gemm.c): its products near a
float64 reference over gguf-py's dequantized weights, its fixed fold sequence bit for bit, each row's bits
independent of the batch, the thread count and the split of N, every level equal to the portable C, and
dequantize/rows bitwise gguf-py's dequantize."""

import gguf
import numpy as np
import pytest
import torch

from kernels import cpu_native, quant_gemm

pytestmark = pytest.mark.skipif(not quant_gemm.available(), reason="the native CPU kernels are off")

TYPES = list(quant_gemm.QUANT_TYPES)
N, K = 24, 512  # N not a multiple of the 16-column work items; K two blocks of 256


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def quantized_weight(qtype: str, n: int = N, k: int = K, seed: int = 0) -> np.ndarray:
    """A valid [n, row_bytes] weight: gguf-py's quantize of random floats for the 32-weight types, random
    blocks (random codes and scales, float16 d and dmin of a realistic size) for the K types."""
    rng = np.random.default_rng(seed)
    gtype = gguf.GGMLQuantizationType[qtype]
    if qtype in ("Q8_0", "Q4_0", "Q4_1"):
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, gtype)
    qt = quant_gemm.QUANT_TYPES[qtype]
    count = n * k // qt.block_elems
    blocks = rng.integers(0, 256, size=(count, qt.block_bytes), dtype=np.uint8)
    scale_at = 208 if qtype == "Q6_K" else 0
    blocks[:, scale_at : scale_at + 2] = _f16(rng.uniform(1e-4, 2e-3, count))
    if qtype != "Q6_K":
        blocks[:, 2:4] = _f16(rng.uniform(1e-4, 2e-3, count))
    return blocks.reshape(n, -1)


def quantized_activations(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's activation quantization in numpy: per block d = max|x| / 127 (float32) and codes
    rint(x * (1 / d)) (0 where d = 0). Returns (codes [M, K] float64, per-element scale [M, K] float64)."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, block)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    codes = np.rint(blocks * inverse)
    scale = np.broadcast_to(d, blocks.shape)
    return codes.reshape(x.shape).astype(np.float64), scale.reshape(x.shape).astype(np.float64)


def activation_block(qtype: str) -> int:
    return 256 if qtype.endswith("_K") else 32


def _x(m: int, k: int = K, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("qtype", TYPES)
def test_matmul_is_the_quantized_rows_times_gguf_py_weights_in_float64(qtype: str) -> None:
    weight = quantized_weight(qtype)
    x = _x(5)
    x[1, :40] = 0.0  # an all-zero activation block
    codes, scale = quantized_activations(x.numpy(), activation_block(qtype))
    w64 = gguf.quants.dequantize(weight, gguf.GGMLQuantizationType[qtype]).astype(np.float64)
    reference = (codes * scale) @ w64.T
    magnitude = np.abs(codes * scale) @ np.abs(w64).T
    got = quant_gemm.matmul(x, torch.from_numpy(weight), qtype).numpy()
    assert np.all(np.abs(got - reference) <= 5e-7 * magnitude + 1e-30)


def test_a_q8_0_element_is_the_documented_float32_fold_in_block_order() -> None:
    """acc = 0; per block acc = acc + float(S) * (d_w * d_x), S the exact integer dot, all float32."""
    weight = quantized_weight("Q8_0", n=3)
    x = _x(2, seed=3)
    codes, scale = quantized_activations(x.numpy(), 32)
    blocks = weight.reshape(3, -1, 34)
    d_w = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    q_w = blocks[..., 2:].copy().view(np.int8).astype(np.int64)
    got = quant_gemm.matmul(x, torch.from_numpy(weight), "Q8_0").numpy()
    for m in range(2):
        q_x = codes[m].reshape(-1, 32).astype(np.int64)
        d_x = scale[m].reshape(-1, 32)[:, 0].astype(np.float32)
        for n in range(3):
            acc = np.float32(0)
            for b in range(q_x.shape[0]):
                dot = np.float32(int(q_w[n, b] @ q_x[b]))
                acc = np.float32(acc + np.float32(dot * np.float32(d_w[n, b] * d_x[b])))
            assert got[m, n].view(np.uint32) == acc.view(np.uint32)


@pytest.mark.parametrize("qtype", TYPES)
def test_a_row_alone_equals_the_row_in_any_batch_thread_count_and_column_split(qtype: str) -> None:
    weight = torch.from_numpy(quantized_weight(qtype))
    x = _x(17, seed=2)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([quant_gemm.matmul(x[i : i + 1], weight, qtype) for i in range(17)])
        torch.set_num_threads(2)
        for rows in (slice(0, 1), slice(0, 3), slice(0, 17), slice(5, 8)):
            assert torch.equal(quant_gemm.matmul(x[rows], weight, qtype), alone[rows])
        shuffled = torch.randperm(17, generator=torch.Generator().manual_seed(0))
        assert torch.equal(quant_gemm.matmul(x[shuffled], weight, qtype), alone[shuffled])
        assert torch.equal(quant_gemm.matmul(x, weight[7:19], qtype), alone[:, 7:19])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("qtype", TYPES)
def test_every_native_level_computes_the_portable_c_bits(qtype: str, monkeypatch) -> None:
    weight = torch.from_numpy(quantized_weight(qtype, seed=4))
    x = _x(6, seed=5)
    portable = quant_gemm._matmul(x, weight, qtype, simd=False)
    for level in cpu_native.supported_levels():
        monkeypatch.setenv("TENSORFOLD_KERNELS", level.name)
        assert cpu_native.level() is level
        assert torch.equal(quant_gemm.matmul(x, weight, qtype), portable), level.name


def test_a_bfloat16_row_gives_its_float32_result_rounded_once() -> None:
    weight = torch.from_numpy(quantized_weight("Q4_K"))
    x = _x(3).to(torch.bfloat16)
    got = quant_gemm.matmul(x, weight, "Q4_K")
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, quant_gemm.matmul(x.float(), weight, "Q4_K").to(torch.bfloat16))


def test_a_matrix_of_a_stack_reads_as_that_matrix_alone() -> None:
    stack = torch.from_numpy(np.stack([quantized_weight("Q6_K", seed=s) for s in range(3)]))
    x = _x(2)
    assert torch.equal(quant_gemm.matmul(x, stack[1], "Q6_K"), quant_gemm.matmul(x, stack[1].clone(), "Q6_K"))


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_and_rows_are_bitwise_gguf_py(qtype: str) -> None:
    weight = quantized_weight(qtype, seed=6)
    expected = gguf.quants.dequantize(weight, gguf.GGMLQuantizationType[qtype])
    got = quant_gemm.dequantize(torch.from_numpy(weight), qtype).numpy()
    assert got.shape == expected.shape and np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    ids = torch.tensor([3, 0, 23, 3])
    picked = quant_gemm.rows(torch.from_numpy(weight), qtype, ids).numpy()
    assert np.array_equal(picked.view(np.uint32), expected[ids.numpy()].view(np.uint32))


def test_bad_inputs_raise_value_errors_naming_the_problem() -> None:
    weight = torch.from_numpy(quantized_weight("Q4_K"))
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block"):
        quant_gemm.matmul(_x(1, k=K - 32), weight[:, :-18], "Q4_K")
    with pytest.raises(ValueError, match="rows hold 287 bytes; Q4_K at K=512 needs 288"):
        quant_gemm.matmul(_x(1), weight[:, :-1], "Q4_K")
    with pytest.raises(ValueError, match="unknown quant type 'Q3_K'"):
        quant_gemm.matmul(_x(1), weight, "Q3_K")
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        quant_gemm.dequantize(weight[:, :-1], "Q4_K")
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        quant_gemm.matmul(_x(1).half(), weight, "Q4_K")
    with pytest.raises(ValueError, match="uint8"):
        quant_gemm.matmul(_x(1), weight.to(torch.int8), "Q4_K")
    with pytest.raises(IndexError):
        quant_gemm.rows(weight, "Q4_K", torch.tensor([N]))


def test_the_types_are_gguf_py_block_layouts() -> None:
    for name, qt in quant_gemm.QUANT_TYPES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] == (qt.block_elems, qt.block_bytes)


@pytest.mark.parametrize("qtype", TYPES)
def test_an_odd_block_count_and_a_partial_column_tile_give_the_portable_bits(qtype: str) -> None:
    """The SIMD tiles' edges: K of 3 blocks (the 32-weight types pair blocks) and N = 16 + 3 columns."""
    k = 3 * quant_gemm.QUANT_TYPES[qtype].block_elems
    weight = torch.from_numpy(quantized_weight(qtype, n=19, k=k, seed=7))
    for m in (1, 5):
        x = _x(m, k=k, seed=8 + m)
        assert torch.equal(quant_gemm.matmul(x, weight, qtype), quant_gemm._matmul(x, weight, qtype, simd=False))


@pytest.mark.parametrize("qtype", TYPES)
def test_a_row_alone_equals_the_row_in_a_batch_split_over_two_threads(qtype: str) -> None:
    """A weight large enough (> 128 KiB) that a call on 2 threads does split its columns."""
    weight = torch.from_numpy(quantized_weight(qtype, n=160, k=1024, seed=9))
    x = _x(3, k=1024, seed=10)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([quant_gemm.matmul(x[i : i + 1], weight, qtype) for i in range(3)])
        torch.set_num_threads(2)
        assert torch.equal(quant_gemm.matmul(x, weight, qtype), alone)
        assert torch.equal(quant_gemm.matmul(x[1:2], weight, qtype), alone[1:2])
        assert torch.equal(quant_gemm._matmul(x, weight, qtype, simd=False), alone)
    finally:
        torch.set_num_threads(previous)


def test_activation_ties_round_to_even_on_every_level(monkeypatch) -> None:
    """Each block's max of 127 makes the scale 1, so x * (1 / d) lands on .5 exactly: every level's
    quantization (lrintf, or AVX-512's VCVTPS2DQ) gives numpy's rint, checked through the Q8_0 fold."""
    k = 64
    x = torch.arange(k, dtype=torch.float32).reshape(1, k) % 9 - 4.5  # -4.5 .. 3.5, ties only
    x[0, ::32] = 127.0
    weight = quantized_weight("Q8_0", n=3, k=k, seed=11)
    codes, scale = quantized_activations(x.numpy(), 32)
    blocks = weight.reshape(3, -1, 34)
    d_w = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    q_w = blocks[..., 2:].copy().view(np.int8).astype(np.int64)
    expected = np.zeros(3, dtype=np.float32)
    for n in range(3):
        for b in range(2):
            dot = np.float32(int(q_w[n, b] @ codes[0, 32 * b : 32 * b + 32].astype(np.int64)))
            expected[n] = np.float32(
                expected[n] + np.float32(dot * np.float32(d_w[n, b] * np.float32(scale[0, 32 * b])))
            )
    for level in cpu_native.supported_levels():
        monkeypatch.setenv("TENSORFOLD_KERNELS", level.name)
        got = quant_gemm.matmul(x, torch.from_numpy(weight), "Q8_0").numpy()[0]
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), level.name

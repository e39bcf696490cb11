"""The CPU path's native kernels (kernels/cpu/*.c): results near a float64 reference (or torch's own), and
every row's bits independent of the row count, the other sequences in the step, prefill chunking and the
thread count."""

import pytest
import torch

from kernels import attention_torch, cpu_attention, cpu_gemm, cpu_layer_ops, cpu_native, dispatch, rmsnorm, rotary
from kernels.activation import silu

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="this CPU lacks AVX-512 BF16 or no C compiler")


@pytest.fixture(autouse=True, params=[level.name for level in cpu_native.supported_levels()] or ["auto"])
def kernel_level(request, monkeypatch) -> str:
    """Every test at each level this CPU has (an AMX machine tests the avx512 level too)."""
    monkeypatch.setenv("TENSORFOLD_KERNELS", request.param)
    return request.param


@pytest.fixture
def threads():
    """Run a call at a given intra-op thread count, restoring torch's afterwards."""
    before = torch.get_num_threads()

    def at(count: int, fn, *args):
        torch.set_num_threads(count)
        try:
            return fn(*args)
        finally:
            torch.set_num_threads(before)

    return at


def packed(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(the original bf16 weight [n, k], a packed copy)."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    copy = weight.clone()
    cpu_gemm.pack_(copy)
    return weight, copy


@pytest.mark.parametrize("n,k", [(80, 64), (256, 768), (1024, 96)])
def test_matmul_rows_do_not_depend_on_row_count_or_threads(n: int, k: int, threads) -> None:
    weight, pack = packed(n, k)
    x = torch.randn(600, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    full = cpu_gemm.matmul(x, pack)
    reference = x.double() @ weight.double().T
    assert (full.double() - reference).abs().max() <= 0.02 * reference.abs().max()
    for rows in (1, 2, 3, 15, 16, 17, 33, 100, 257):
        start = (rows * 7) % (600 - rows)
        assert torch.equal(cpu_gemm.matmul(x[start : start + rows], pack), full[start : start + rows]), rows
    assert torch.equal(threads(1, cpu_gemm.matmul, x[:40], pack), threads(2, cpu_gemm.matmul, x[:40], pack))


@pytest.mark.parametrize("n,k", [(80, 96), (320, 2048), (192, 32)])
def test_matmul_rows_are_the_same_bits_at_any_row_count_and_thread_count(n: int, k: int, threads) -> None:
    """Every (row count, thread count) pair gives each row the bits it has alone on one thread."""
    weight, pack = packed(n, k, seed=3)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    alone = torch.cat([threads(1, cpu_gemm.matmul, x[row : row + 1], pack) for row in range(300)])
    reference = x.double() @ weight.double().T  # bf16 products are exact in fp32: only fp32 sums round
    assert (alone.double() - reference).abs().max() <= 0.01 * reference.abs().max()
    for count in (1, 2):
        for rows in (1, 2, 3, 16, 17, 300):
            assert torch.equal(threads(count, cpu_gemm.matmul, x[:rows], pack), alone[:rows]), (count, rows)


def cancelling(n: int, k: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [rows, k], weight [n, k]) bf16 whose first product is large and whose last cancels it: every sum
    between rounds at the large one's scale, so a sum over K in any other order shows in the bf16 result."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    weight[:, 0] = (65536 * (1.5 + 0.5 * torch.rand(n, generator=gen))).to(torch.bfloat16)
    weight[:, -1] = -weight[:, 0]
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    x[:, 0] = x[:, -1] = 1
    return x, weight


def test_every_row_count_up_to_33_gives_each_row_its_bits_alone(threads) -> None:
    """Row counts 1..33 meet every register block and remainder of rows; K = 544 runs the avx2 kernel's fp32
    slabs of x (256 elements of K) twice and a partial third; 80 columns end in a group of one tile."""
    x, weight = cancelling(80, 544, 33, seed=7)
    pack = weight.clone()
    cpu_gemm.pack_(pack)
    alone = torch.cat([threads(1, cpu_gemm.matmul, x[row : row + 1], pack) for row in range(33)])
    for rows in range(1, 34):
        for count in (1, 2):
            assert torch.equal(threads(count, cpu_gemm.matmul, x[:rows], pack), alone[:rows]), (rows, count)


@pytest.mark.parametrize("k", [96, 544])
def test_the_avx2_gemm_is_the_fp32_sum_in_k_order(kernel_level: str, k: int) -> None:
    """At the avx2 level each element is acc += x[k] * w[k] in fp32, k ascending, rounded once to bf16 (a bf16
    product is exact, so FMA and multiply-then-add agree); 544 crosses the kernel's slabs of K, and 7 rows
    take a register block of 4 and one of 3."""
    if kernel_level != "avx2":
        pytest.skip("the other levels sum pairs of K (VDPBF16PS) or tiles (AMX)")
    x, weight = cancelling(48, k, 7, seed=6)
    pack = weight.clone()
    cpu_gemm.pack_(pack)
    acc = torch.zeros(7, 48)
    for i in range(k):
        acc = acc + x[:, i : i + 1].float() * weight[:, i].float()
    assert torch.equal(cpu_gemm.matmul(x, pack), acc.to(torch.bfloat16))


def test_packed_rows_read_back_the_original_rows() -> None:
    weight, pack = packed(96, 64)
    ids = torch.tensor([0, 95, 17, 17, 48])
    assert torch.equal(cpu_gemm.rows(pack, ids), weight[ids])
    with pytest.raises(IndexError):
        cpu_gemm.rows(pack, torch.tensor([96]))


def test_a_packed_stack_packs_each_matrix() -> None:
    stack = torch.randn(3, 32, 64).to(torch.bfloat16)
    original = stack.clone()
    cpu_gemm.pack_(stack)
    x = torch.randn(5, 64).to(torch.bfloat16)
    for e in range(3):
        assert cpu_gemm.is_packed(stack[e])
        expected = cpu_gemm.matmul(x, _pack_like(original[e]))
        assert torch.equal(cpu_gemm.matmul(x, stack[e]), expected)
    assert not cpu_gemm.is_packed(stack[0, :16])


def test_a_packed_expert_stack_matches_a_float64_reference_per_expert(threads) -> None:
    gen = torch.Generator().manual_seed(5)
    stack = torch.randn(4, 128, 256, generator=gen).to(torch.bfloat16)
    original = stack.clone()
    cpu_gemm.pack_(stack)
    x = torch.randn(17, 256, generator=gen).to(torch.bfloat16)
    for e in range(4):
        reference = x.double() @ original[e].double().T
        got = threads(2, cpu_gemm.matmul, x, stack[e])
        assert (got.double() - reference).abs().max() <= 0.01 * reference.abs().max()
        assert torch.equal(threads(1, cpu_gemm.matmul, x[5:6], stack[e]), got[5:6])
        assert torch.equal(cpu_gemm.rows(stack[e], torch.tensor([0, 127, 64])), original[e][[0, 127, 64]])


def _pack_like(weight: torch.Tensor) -> torch.Tensor:
    copy = weight.clone()
    cpu_gemm.pack_(copy)
    return copy


def test_weights_the_kernel_cannot_take_are_refused() -> None:
    assert not cpu_gemm.can_pack(torch.zeros(24, 64, dtype=torch.bfloat16))  # N not a multiple of 16
    assert not cpu_gemm.can_pack(torch.zeros(32, 48, dtype=torch.bfloat16))  # K not a multiple of 32
    assert not cpu_gemm.can_pack(torch.zeros(32, 64))  # float32 stays on torch's tiles
    with pytest.raises(ValueError):
        cpu_gemm.pack_(torch.zeros(24, 64, dtype=torch.bfloat16))


# ---- attention --------------------------------------------------------------------------------------------
class Step:
    """Random paged K/V for sequences of given context lengths, with shuffled block tables."""

    def __init__(self, lengths: list[int], dtype: torch.dtype, heads: int = 6, kv_heads: int = 2, dim: int = 64):
        gen = torch.Generator().manual_seed(3)
        self.block_size, self.lengths, self.heads = 16, lengths, heads
        blocks = sum(-(-n // 16) for n in lengths)
        order = torch.randperm(blocks, generator=gen).tolist()
        self.tables, at = [], 0
        for n in lengths:
            count = -(-n // 16)
            self.tables.append(order[at : at + count])
            at += count
        shape = (blocks, 16, kv_heads, dim)
        self.k = torch.randn(shape, generator=gen).to(dtype)
        self.v = torch.randn(shape, generator=gen).to(dtype)
        self.q = {i: torch.randn(n, heads, dim, generator=gen).to(dtype) for i, n in enumerate(lengths)}

    def run(self, queries: list[tuple[int, int, int]], window: int = 0) -> torch.Tensor:
        """queries: (sequence, first query position, count) -> the rows' outputs, in order."""
        q = torch.cat([self.q[s][first : first + count] for s, first, count in queries])
        query_lens = [count for _, _, count in queries]
        context_lens = [first + count for _, first, count in queries]
        tables = [self.tables[s] for s, _, _ in queries]
        layout = cpu_attention.row_layout(query_lens, context_lens, tables)
        return cpu_attention.paged_attention(q, self.k, self.v, layout, scale=0.125, window=window)


@pytest.mark.parametrize("window", [0, 1, 20, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_attention_matches_a_float64_reference(dtype: torch.dtype, window: int) -> None:
    step = Step([37, 5, 70], dtype)
    ours = step.run([(0, 30, 7), (1, 4, 1), (2, 0, 70)], window).double()
    reference = []
    for s, first, count in [(0, 30, 7), (1, 4, 1), (2, 0, 70)]:
        keys = attention_torch.gather_cache(step.k, step.tables[s], first + count).double()
        values = attention_torch.gather_cache(step.v, step.tables[s], first + count).double()
        reference.append(
            attention_torch.causal_attention(step.q[s][first : first + count].double(), keys, values, 0.125, window)
        )
    expected = torch.cat(reference)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (ours - expected).abs().max() < tolerance


# Head sizes with a compiled variant (64, 128) and without (96); KV groups that cut a row's heads across tiles
# (3 heads per KV head, 4 rows a tile), fill whole tiles (8) or give one head per KV head.
# Windows (sliding-window layers) that start mid-chunk and mid-block, and one wider than every context.
@pytest.mark.parametrize("window", [0, 13, 40, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 64), (8, 1, 128), (4, 4, 96)])
def test_attention_rows_do_not_depend_on_the_step(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, window: int, threads
) -> None:
    step = Step([50, 23, 90], dtype, heads, kv_heads, dim)
    whole = step.run([(0, 0, 50)], window)
    for chunk in (1, 7, 16):  # prefill in chunks: each chunk's rows equal the whole pass's
        parts = [step.run([(0, at, min(chunk, 50 - at))], window) for at in range(0, 50, chunk)]
        assert torch.equal(torch.cat(parts), whole), chunk
    mixed = step.run([(1, 10, 13), (0, 40, 10), (2, 0, 90)], window)  # batched with other sequences
    assert torch.equal(mixed[13:23], whole[40:50])
    one = threads(1, step.run, [(2, 0, 90)], window)
    assert torch.equal(threads(2, step.run, [(2, 0, 90)], window), one)


def test_a_window_reads_no_key_before_it() -> None:
    """Native and torch paths alike: blocks wholly below every row's window may hold anything."""
    step = Step([90], torch.float32)
    q = step.q[0][80:90]

    def torch_path() -> torch.Tensor:
        return attention_torch.paged_attention_torch(q, step.k, step.v, [10], [90], step.tables, 0.125, 20)

    before, torch_before = step.run([(0, 80, 10)], window=20), torch_path()
    for block in step.tables[0][:3]:  # keys 0..47: below every row's window (rows see 61.. and later)
        step.k[block] = float("nan")
        step.v[block] = float("nan")
    assert torch.equal(step.run([(0, 80, 10)], window=20), before)
    assert torch.equal(torch_path(), torch_before)


# ---- the layer's elementwise parts and the greedy argmax ---------------------------------------------------
NARROW = [torch.bfloat16, torch.float16]


def _close_in_dtype(ours: torch.Tensor, theirs: torch.Tensor, steps: int = 1) -> bool:
    """Every element within `steps` relative steps of its dtype (our sum of squares and exp are our own;
    silu_mul rounds twice, so a step in silu can become two in the product)."""
    gap = (ours.float() - theirs.float()).abs()
    step = theirs.float().abs() * (2.0**-7 if theirs.dtype == torch.bfloat16 else 2.0**-10)
    return bool((gap <= steps * step + 1e-30).all())


@pytest.mark.parametrize("dtype", NARROW)
def test_rms_norm_rows_are_their_own_and_match_torch(dtype: torch.dtype, threads) -> None:
    gen = torch.Generator().manual_seed(5)
    x, residual = (torch.randn(130, 200, generator=gen).to(dtype) for _ in range(2))  # 200: a masked tail chunk
    weight = (1 + 0.1 * torch.randn(200, generator=gen)).to(dtype)
    normed, summed = cpu_layer_ops.rms_norm(x, weight, 1e-6, residual)
    expected, expected_sum = rmsnorm.add_rms_norm_torch(x, residual, weight, 1e-6)
    assert torch.equal(summed, expected_sum) and _close_in_dtype(normed, expected)
    assert (normed == expected).float().mean() > 0.999
    for rows in (1, 3, 17, 64):  # a row's bits are the same in any call (threads fork at 64 rows)
        part, _ = cpu_layer_ops.rms_norm(x[rows : 2 * rows], weight, 1e-6, residual[rows : 2 * rows])
        assert torch.equal(part, normed[rows : 2 * rows]), rows
    assert torch.equal(
        threads(1, cpu_layer_ops.rms_norm, x, weight, 1e-6)[0], threads(2, cpu_layer_ops.rms_norm, x, weight, 1e-6)[0]
    )


@pytest.mark.parametrize("dtype", [torch.float32, *NARROW])
@pytest.mark.parametrize("rotated", [64, 32, 16])  # whole heads, and partial RoPE that copies the rest
def test_rotary_gives_torchs_bits(dtype: torch.dtype, rotated: int) -> None:
    gen = torch.Generator().manual_seed(6)
    q, k = torch.randn(70, 6, 64, generator=gen).to(dtype), torch.randn(70, 2, 64, generator=gen).to(dtype)
    positions = torch.randint(0, 5000, (70,), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotated, 2).float() / rotated))
    ours = cpu_layer_ops.rotary(positions, q, k, inv_freq, 0.9)
    theirs = rotary.rotary_torch(positions, q, k, inv_freq, 0.9, interleaved=False)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    alone = cpu_layer_ops.rotary(positions[5:6].clone(), q[5:6], k[5:6], inv_freq, 0.9)  # one decode row
    assert torch.equal(alone[0], ours[0][5:6])


@pytest.mark.parametrize("dtype", NARROW)
def test_silu_mul_is_elementwise_and_matches_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    gate, up = (4 * torch.randn(40, 1000, generator=gen)).to(dtype), torch.randn(40, 1000, generator=gen).to(dtype)
    ours = cpu_layer_ops.silu_mul(gate, up, 1000)
    assert _close_in_dtype(ours, silu(gate) * up, steps=2) and (ours == silu(gate) * up).float().mean() > 0.999
    assert torch.equal(cpu_layer_ops.silu_mul(gate[7:8], up[7:8], 1000), ours[7:8])
    fused = torch.cat([gate, up], dim=-1)  # a fused gate/up output: its halves are strided views
    halves = fused[:, :1000], fused[:, 1000:]
    assert cpu_layer_ops.rows_of(*halves) == 2000
    assert torch.equal(dispatch.silu_mul(*halves), ours)


@pytest.mark.parametrize("dtype", NARROW)
def test_wide_rms_norm_rows_are_their_own_and_match_torch(dtype: torch.dtype, threads) -> None:
    """The float32-scaled RMSNorm (Gemma's sandwich norms): within a step of torch's composition, each row's bits
    the same in any call and thread count."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(130, 200, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(200, generator=gen)).to(dtype)
    ours = cpu_layer_ops.rms_norm_wide(x, weight, 1e-6)
    expected = rmsnorm.wide_rms_norm_torch(x, weight.float(), 1e-6)
    assert _close_in_dtype(ours, expected) and (ours == expected).float().mean() > 0.999
    for rows in (1, 3, 17, 64):
        assert torch.equal(cpu_layer_ops.rms_norm_wide(x[rows : 2 * rows], weight, 1e-6), ours[rows : 2 * rows])
    one = threads(1, cpu_layer_ops.rms_norm_wide, x, weight, 1e-6)
    assert torch.equal(threads(2, cpu_layer_ops.rms_norm_wide, x, weight, 1e-6), one)


@pytest.mark.parametrize("dtype", NARROW)
def test_gelu_tanh_mul_is_elementwise_and_matches_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(9)
    gate, up = (4 * torch.randn(40, 1000, generator=gen)).to(dtype), torch.randn(40, 1000, generator=gen).to(dtype)
    # torch's tanh form saturates to exactly -0.0 below about -7 (1 + tanh(u) cancels); ours keeps the tail
    # (|gelu| < 1e-16 there), so the comparison has an absolute floor.
    expected = torch.nn.functional.gelu(gate.double(), approximate="tanh").to(dtype) * up
    ours = cpu_layer_ops.gelu_tanh_mul(gate, up, 1000)
    gap = (ours.double() - expected.double()).abs()
    step = expected.double().abs() * (2.0**-7 if dtype == torch.bfloat16 else 2.0**-10)
    assert bool((gap <= 2 * step + 1e-15).all()) and (ours == expected).float().mean() > 0.95
    assert torch.equal(cpu_layer_ops.gelu_tanh_mul(gate[7:8], up[7:8], 1000), ours[7:8])
    fused = torch.cat([gate, up], dim=-1)  # a fused gate/up output's halves
    assert torch.equal(dispatch.gelu_tanh_mul(fused[:, :1000], fused[:, 1000:]), ours)


def test_argmax_rows_is_torchs_argmax() -> None:
    gen = torch.Generator().manual_seed(8)
    for cols in (1, 15, 16, 17, 1000):
        logits = torch.randint(0, 3, (12, cols), generator=gen).float()  # ties everywhere: the lowest index wins
        logits[1] = -float("inf")
        logits[2, cols // 2] = float("nan")  # a NaN row gives its first NaN, as torch does
        assert cpu_layer_ops.argmax_rows(logits) == torch.argmax(logits, dim=-1).tolist(), cols
    wide = torch.randn(3, 151936, generator=gen)
    assert cpu_layer_ops.argmax_rows(wide) == torch.argmax(wide, dim=-1).tolist()


def test_fused_sibling_projections_give_each_projections_bits() -> None:
    from deployments.model_rank.layers.linear import FusedProjection, ReplicatedLinear

    gen = torch.Generator().manual_seed(9)
    siblings = [ReplicatedLinear(96, n) for n in (128, 64, 192)]
    for module in siblings:
        module.weight.data = torch.randn(module.weight.shape, generator=gen).to(torch.bfloat16)
        cpu_gemm.pack_(module.weight)
    x = torch.randn(21, 96, generator=gen).to(torch.bfloat16)
    separate = [module(x) for module in siblings]
    assert FusedProjection.fits(siblings)
    fused = FusedProjection(siblings)
    for alone, part, module in zip(separate, fused(x), siblings):
        assert torch.equal(part, alone) and torch.equal(module(x), alone)  # each weight is now a view of the pack
    assert not FusedProjection.fits([ReplicatedLinear(96, 48), ReplicatedLinear(96, 64)])  # unpacked, a part group

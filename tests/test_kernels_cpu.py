"""The CPU path's native kernels (kernels/cpu/*.c): results near a float64 reference, and every row's bits
independent of the row count, the other sequences in the step, prefill chunking and the thread count."""

import pytest
import torch

from kernels import attention_torch, cpu_attention, cpu_gemm, cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="this CPU lacks AMX/AVX-512 BF16 or no C compiler")


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

    def run(self, queries: list[tuple[int, int, int]]) -> torch.Tensor:
        """queries: (sequence, first query position, count) -> the rows' outputs, in order."""
        q = torch.cat([self.q[s][first : first + count] for s, first, count in queries])
        query_lens = [count for _, _, count in queries]
        context_lens = [first + count for _, first, count in queries]
        tables = [self.tables[s] for s, _, _ in queries]
        layout = cpu_attention.row_layout(query_lens, context_lens, tables)
        return cpu_attention.paged_attention(q, self.k, self.v, layout, scale=0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_attention_matches_a_float64_reference(dtype: torch.dtype) -> None:
    step = Step([37, 5, 70], dtype)
    ours = step.run([(0, 30, 7), (1, 4, 1), (2, 0, 70)]).double()
    reference = []
    for s, first, count in [(0, 30, 7), (1, 4, 1), (2, 0, 70)]:
        keys = attention_torch.gather_cache(step.k, step.tables[s], first + count).double()
        values = attention_torch.gather_cache(step.v, step.tables[s], first + count).double()
        reference.append(attention_torch.causal_attention(step.q[s][first : first + count].double(), keys, values, 0.125))
    expected = torch.cat(reference)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (ours - expected).abs().max() < tolerance


# Head sizes with a compiled variant (64, 128) and without (96); KV groups that cut a row's heads across tiles
# (3 heads per KV head, 4 rows a tile), fill whole tiles (8) or give one head per KV head.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 64), (8, 1, 128), (4, 4, 96)])
def test_attention_rows_do_not_depend_on_the_step(dtype: torch.dtype, heads: int, kv_heads: int, dim: int,
                                                  threads) -> None:  # fmt: skip
    step = Step([50, 23, 90], dtype, heads, kv_heads, dim)
    whole = step.run([(0, 0, 50)])
    for chunk in (1, 7, 16):  # prefill in chunks: each chunk's rows equal the whole pass's
        parts = [step.run([(0, at, min(chunk, 50 - at))]) for at in range(0, 50, chunk)]
        assert torch.equal(torch.cat(parts), whole), chunk
    mixed = step.run([(1, 10, 13), (0, 40, 10), (2, 0, 90)])  # batched with other sequences
    assert torch.equal(mixed[13:23], whole[40:50])
    one = threads(1, step.run, [(2, 0, 90)])
    assert torch.equal(threads(2, step.run, [(2, 0, 90)]), one)

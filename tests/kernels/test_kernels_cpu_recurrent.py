"""The recurrent layers' native CPU kernels (kernels/cpu/recurrent.c) against the torch reference
(kernels/recurrent_scan.py): outputs, advanced and captured states; and each token's bits independent of the
other sequences in the step, how its sequence was chunked and the thread count."""

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_recurrent, dispatch, recurrent_scan
from kernels.recurrent_scan import ScanRows

pytestmark = pytest.mark.skipif(not cpu_recurrent.available(), reason="no C compiler with OpenMP")

SLOTS = 10
LENGTHS = (5, 0, 1, 9)  # an empty sequence and a single token among longer ones
SEQ_SLOTS = (3, 0, 5, 1)
CAPTURES = ((2, 6), (4, 7), (6, 8), (14, 9), (11, 2))  # (flat row, slot): mid-sequence, last rows, a lone token


@dataclass
class Case:
    """One kernel's arguments: pools advanced in place, per-token inputs [T, ...] and per-layer ones."""

    name: str
    pools: list[torch.Tensor]
    tokens: list[torch.Tensor]
    fixed: tuple
    call: Callable  # (module, pools, tokens, fixed, rows) -> out [T, ...]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def conv_case(dtype: torch.dtype, total: int) -> Case:
    channels, kernel, g = 70, 4, _gen(1)  # 70: a block and a partial one
    x = torch.randn(total, channels + 6, generator=g).to(dtype)[:, 3 : 3 + channels]  # a column slice, as split
    history = torch.randn(SLOTS, kernel - 1, channels, generator=g).to(dtype)
    weight, bias = torch.randn(channels, kernel, generator=g).to(dtype), torch.randn(channels, generator=g).to(dtype)

    def call(module, pools, tokens, fixed, rows):
        return module.causal_conv_scan(tokens[0], pools[0], *fixed, rows)

    return Case("conv", [history], [x], (weight, bias), call)


def delta_case(dtype: torch.dtype, total: int) -> Case:
    heads, dk, dv, g = 3, 16, 24, _gen(2)
    q = F.normalize(torch.randn(total, heads, dk, generator=g), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(total, heads, dk, generator=g), dim=-1)
    v = torch.randn(total, heads, dv, generator=g)
    a, beta = torch.randn(total, heads, generator=g).to(dtype), torch.rand(total, heads, generator=g)
    state = torch.randn(SLOTS, heads, dk, dv, generator=g)
    neg_a, dt_bias = -torch.rand(heads, generator=g) * 4, torch.randn(heads, generator=g).to(dtype)

    def call(module, pools, tokens, fixed, rows):
        return module.gated_delta_scan(pools[0], *tokens, *fixed, rows)

    return Case("delta", [state], [q, k, v, a, beta], (neg_a, dt_bias), call)


def kda_case(dtype: torch.dtype, total: int) -> Case:
    """Kimi delta attention: every input float32 (`dtype` unused); g's log-decays differ per key channel."""
    heads, dk, dv, g = 2, 12, 20, _gen(4)
    q = F.normalize(torch.randn(total, heads, dk, generator=g), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(total, heads, dk, generator=g), dim=-1)
    v = torch.randn(total, heads, dv, generator=g)
    decays = -torch.rand(total, heads, dk, generator=g) * 3  # some channels near 1, others near exp(-3)
    beta, state = torch.rand(total, heads, generator=g), torch.randn(SLOTS, heads, dk, dv, generator=g)

    def call(module, pools, tokens, fixed, rows):
        return module.kda_scan(pools[0], *tokens, rows)

    return Case("kda", [state], [q, k, v, decays, beta], (), call)


def mamba_case(dtype: torch.dtype, total: int, limit: tuple[float, float] = (0.0, float("inf"))) -> Case:
    heads, head_dim, state_size, g = 4, 8, 20, _gen(3)  # 20: 16 lanes and a tail
    x = torch.randn(total, heads, head_dim, generator=g)
    b, c = torch.randn(total, heads, state_size, generator=g), torch.randn(total, heads, state_size, generator=g)
    dt = torch.randn(total, heads + 2, generator=g).to(dtype)[:, :heads]  # a column slice of in_proj's output
    state = torch.randn(SLOTS, heads, head_dim, state_size, generator=g)
    dt_bias, a, d = torch.randn(heads, generator=g).to(dtype), -torch.rand(heads, generator=g) * 4, torch.randn(heads)

    def call(module, pools, tokens, fixed, rows):
        return module.mamba2_scan(pools[0], *tokens, *fixed, rows)

    return Case("mamba", [state], [x, b, c, dt], (dt_bias, a, d, limit), call)


CASES = {"conv": conv_case, "delta": delta_case, "kda": kda_case, "mamba": mamba_case}


def spans(lengths: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return tuple(starts), tuple(s + n for s, n in zip(starts, lengths))


def run(case: Case, module, rows: ScanRows, pools: list[torch.Tensor] | None = None, threads: int = 1):
    """(out, the pools after) of one call on copies of the case's pools (or on `pools`, advanced)."""
    pools = [p.clone() for p in case.pools] if pools is None else pools
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return case.call(module, pools, case.tokens, case.fixed, rows), pools
    finally:
        torch.set_num_threads(before)


def whole_step() -> ScanRows:
    starts, ends = spans(LENGTHS)
    return ScanRows(starts, ends, SEQ_SLOTS, CAPTURES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_torch_reference(name: str, dtype: torch.dtype) -> None:
    case = CASES[name](dtype, sum(LENGTHS))
    ours, our_pools = run(case, cpu_recurrent, whole_step())
    theirs, their_pools = run(case, recurrent_scan, whole_step())
    if name == "conv":  # the same products summed in the same order: torch's bits
        assert torch.equal(ours, theirs) and torch.equal(our_pools[0], their_pools[0])
        return
    # The recurrences sum in their own order and call libm's exp: float32 rounding apart.
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(our_pools[0], their_pools[0], rtol=1e-5, atol=1e-5)
    untouched = [s for s in range(SLOTS) if s not in SEQ_SLOTS + tuple(slot for _, slot in CAPTURES)]
    assert torch.equal(our_pools[0][untouched], case.pools[0][untouched])


def test_mamba2_time_step_limit_is_applied() -> None:
    case = mamba_case(torch.bfloat16, sum(LENGTHS), limit=(0.05, 0.5))
    ours, pools = run(case, cpu_recurrent, whole_step())
    theirs, their_pools = run(case, recurrent_scan, whole_step())
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pools[0], their_pools[0], rtol=1e-5, atol=1e-5)
    free, _ = run(mamba_case(torch.bfloat16, sum(LENGTHS)), cpu_recurrent, whole_step())
    assert not torch.equal(ours, free)


def sequence_alone(case: Case, index: int, chunks: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Sequence `index` of the whole step in consecutive calls of `chunks` tokens, each in a step of its own
    (its captures with it)."""
    starts, ends = spans(LENGTHS)
    pools, outs, offset = [p.clone() for p in case.pools], [], starts[index]
    for size in chunks:
        piece = Case(case.name, pools, [t[offset : offset + size] for t in case.tokens], case.fixed, case.call)
        captures = tuple((row - offset, slot) for row, slot in CAPTURES if offset <= row < offset + size)
        outs.append(run(piece, cpu_recurrent, ScanRows((0,), (size,), (SEQ_SLOTS[index],), captures), pools)[0])
        offset += size
    assert offset == ends[index]
    return torch.cat(outs), pools


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_tokens_do_not_depend_on_batch_chunks_or_threads(
    name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = CASES[name](dtype, sum(LENGTHS))
    out, pools = run(case, cpu_recurrent, whole_step())
    monkeypatch.setattr(cpu_recurrent, "PARALLEL_WORK", 0)  # these small calls too on two threads
    two_threads, two_thread_pools = run(case, cpu_recurrent, whole_step(), threads=2)
    assert torch.equal(out, two_threads) and torch.equal(pools[0], two_thread_pools[0])
    starts, ends = spans(LENGTHS)
    for index, chunks in [(0, (5,)), (0, (2, 3)), (2, (1,)), (3, (9,)), (3, (1, 4, 1, 3))]:
        alone, alone_pools = sequence_alone(case, index, chunks)
        assert torch.equal(alone, out[starts[index] : ends[index]]), (index, chunks)
        touched = [SEQ_SLOTS[index]] + [slot for row, slot in CAPTURES if starts[index] <= row < ends[index]]
        assert torch.equal(alone_pools[0][touched], pools[0][touched]), (index, chunks)


def test_mamba2_step_rounds_as_torch_for_every_bfloat16() -> None:
    """With one-element states, y is the step itself: softplus(dt + dt_bias) in bfloat16 gives torch's bits
    for every finite bfloat16 sum (torch's vectorised and per-token calls alike)."""
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = values[values.float().isfinite()]
    heads = 64
    tokens = -(-values.numel() // heads)
    dt = torch.zeros(tokens * heads, dtype=torch.bfloat16)
    dt[: values.numel()] = values
    dt, dt_bias, ones = dt.view(tokens, heads), torch.zeros(heads, dtype=torch.bfloat16), torch.ones(tokens, heads, 1)
    rows = ScanRows(tuple(range(tokens)), tuple(range(1, tokens + 1)), tuple(range(tokens)))
    state, zeros = torch.zeros(tokens, heads, 1, 1), torch.zeros(heads)
    step = cpu_recurrent.mamba2_scan(state, ones, ones, ones, dt, dt_bias, zeros, zeros, (0.0, float("inf")), rows)
    assert torch.equal(step[..., 0], F.softplus(dt + dt_bias).float())
    assert torch.equal(step[..., 0], torch.stack([F.softplus(row + dt_bias) for row in dt]).float())


def test_dispatch_takes_the_native_kernels_unless_told_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    case = delta_case(torch.float32, sum(LENGTHS))
    native, _ = run(case, dispatch, whole_step())
    assert torch.equal(native, run(case, cpu_recurrent, whole_step())[0])
    monkeypatch.setenv("TENSORFOLD_KERNELS", "torch")
    assert not cpu_recurrent.available()
    assert torch.equal(run(case, dispatch, whole_step())[0], run(case, recurrent_scan, whole_step())[0])


def test_two_sequences_batched_or_alone_give_the_same_kda_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sequences (captures in each) in one call on one and on two threads, and each in a call of its own:
    identical outputs and states."""
    case, lengths, slots, captures = kda_case(torch.float32, 9), (4, 5), (1, 3), ((1, 6), (8, 7))
    starts, ends = spans(lengths)
    together, pools = run(case, cpu_recurrent, ScanRows(starts, ends, slots, captures))
    monkeypatch.setattr(cpu_recurrent, "PARALLEL_WORK", 0)
    threaded, threaded_pools = run(case, cpu_recurrent, ScanRows(starts, ends, slots, captures), threads=2)
    assert torch.equal(threaded, together) and torch.equal(threaded_pools[0], pools[0])
    for start, end, slot in zip(starts, ends, slots):
        piece = Case(case.name, case.pools, [t[start:end] for t in case.tokens], case.fixed, case.call)
        mine = tuple((row - start, target) for row, target in captures if start <= row < end)
        alone, alone_pools = run(piece, cpu_recurrent, ScanRows((0,), (end - start,), (slot,), mine))
        assert torch.equal(alone, together[start:end])
        touched = [slot] + [target for _, target in mine]
        assert torch.equal(alone_pools[0][touched], pools[0][touched])


def test_dispatch_takes_the_native_kda_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    case = kda_case(torch.float32, sum(LENGTHS))
    assert torch.equal(run(case, dispatch, whole_step())[0], run(case, cpu_recurrent, whole_step())[0])
    monkeypatch.setenv("TENSORFOLD_KERNELS", "torch")
    assert torch.equal(run(case, dispatch, whole_step())[0], run(case, recurrent_scan, whole_step())[0])


def test_unsupported_dtypes_and_shapes_keep_torch() -> None:
    case = conv_case(torch.float16, sum(LENGTHS))
    assert not cpu_recurrent.conv_supported(case.tokens[0], case.pools[0], *case.fixed)
    assert torch.equal(run(case, dispatch, whole_step())[0], run(case, recurrent_scan, whole_step())[0])
    conv = conv_case(torch.float32, sum(LENGTHS))
    assert cpu_recurrent.conv_supported(conv.tokens[0], conv.pools[0], *conv.fixed)
    assert not cpu_recurrent.conv_supported(conv.tokens[0][:, 1:], conv.pools[0], *conv.fixed)
    delta = delta_case(torch.float32, sum(LENGTHS))
    assert cpu_recurrent.gated_delta_supported(delta.pools[0], *delta.tokens, *delta.fixed)
    assert not cpu_recurrent.gated_delta_supported(delta.pools[0][:, :2], *delta.tokens, *delta.fixed)
    kda = kda_case(torch.float32, sum(LENGTHS))
    assert cpu_recurrent.kda_supported(kda.pools[0], *kda.tokens)
    assert not cpu_recurrent.kda_supported(kda.pools[0][..., :8], *kda.tokens)
    q, k, v, g, beta = kda.tokens
    assert not cpu_recurrent.kda_supported(kda.pools[0], q, k, v, g.bfloat16(), beta)
    assert not cpu_recurrent.kda_supported(kda.pools[0], q, k, v, g[..., :1], beta)  # one decay per head
    mamba = mamba_case(torch.float32, sum(LENGTHS))
    assert cpu_recurrent.mamba2_supported(mamba.pools[0], *mamba.tokens, *mamba.fixed[:3])
    assert not cpu_recurrent.mamba2_supported(mamba.pools[0][..., :8], *mamba.tokens, *mamba.fixed[:3])

"""The recurrent layers' Triton kernels (causal conv, gated delta rule, KDA, Mamba2) against recurrent_scan.py, and
their exactness: a sequence's outputs and states are bit-identical alone, in a batch and in two chunks."""

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kernels.testing import TOLERANCE, assert_close, case_generator, kernel_test_device, randn, relative_error

DEVICE = kernel_test_device()  # turns the interpreter on before Triton is imported
pytest.importorskip(
    "triton", reason="Triton is not importable: kernel tests need it (pip install triton)", exc_type=ImportError
)

from kernels import causal_conv_scan, gated_delta_scan, kda_scan, mamba2_scan, recurrent_scan  # noqa: E402
from kernels._triton import jit, tl  # noqa: E402
from kernels.recurrent_scan import ScanRows  # noqa: E402
from kernels.scan_meta import build_scan_meta, softplus  # noqa: E402

# A step: a prefill chunk, an idle sequence, two decode rows and a draft-sized run; one unused slot (0).
LENGTHS, SLOTS, POOL = [5, 0, 1, 7, 1], [3, 6, 5, 1, 4], 10
CAPTURES = ((1, 7), (4, 8), (9, 9), (9, 2), (13, 0))  # several per sequence, two at one row, the last row


def scan_rows(lengths: list[int], slots: list[int], captures: tuple = ()) -> ScanRows:
    ends = torch.tensor(lengths).cumsum(0).tolist()
    return ScanRows(tuple(e - n for e, n in zip(ends, lengths)), tuple(ends), tuple(slots), captures)


def meta(rows: ScanRows, total: int):
    return build_scan_meta(rows, total, DEVICE)


@dataclass
class Case:
    """One kernel's inputs: a pool, per-row inputs (dim 0 the flat row) and a launch over given rows."""

    pool: torch.Tensor
    rows_of: Callable[[int], dict[str, torch.Tensor]]  # fresh per-row inputs for n rows
    run: Callable[[torch.Tensor, dict[str, torch.Tensor], ScanRows], torch.Tensor]  # Triton, pool in place
    reference: Callable[[torch.Tensor, dict[str, torch.Tensor], ScanRows], torch.Tensor]  # float64 torch
    copies_inputs: bool = False  # the pool holds copies of inputs (conv histories): compared bit for bit


def conv_case(gen: torch.Generator, dtype: torch.dtype, width: int = 4, bias: bool = True) -> Case:
    channels = 40
    weight = randn(channels, width, dtype=dtype, device=DEVICE, gen=gen)
    b = randn(channels, dtype=dtype, device=DEVICE, gen=gen) if bias else None

    def run(pool, inputs, rows):
        return causal_conv_scan.causal_conv_scan(inputs["x"], pool, weight, b, meta(rows, len(inputs["x"])), 16)

    def reference(pool, inputs, rows):
        return recurrent_scan.causal_conv_scan(inputs["x"], pool, weight, b, rows)

    return Case(
        randn(POOL, width - 1, channels, dtype=dtype, device=DEVICE, gen=gen),
        lambda n: {"x": randn(n, channels, dtype=dtype, device=DEVICE, gen=gen)},
        run,
        reference,
        copies_inputs=True,
    )


def delta_case(gen: torch.Generator, dtype: torch.dtype) -> Case:
    heads, key_heads, key_dim, value_dim = 4, 2, 16, 20  # value heads share key heads, as the layer repeats them
    neg_a = -randn(heads, dtype=torch.float32, device=DEVICE, gen=gen, scale=0.5).exp()
    dt_bias = randn(heads, dtype=dtype, device=DEVICE, gen=gen)

    def keys(n: int) -> torch.Tensor:
        k = F.normalize(randn(n, key_heads, key_dim, dtype=torch.float32, device=DEVICE, gen=gen), dim=-1)
        return k.repeat_interleave(heads // key_heads, dim=1)

    def rows_of(n: int) -> dict[str, torch.Tensor]:
        return {
            "q": keys(n) * key_dim**-0.5,
            "k": keys(n),
            "v": randn(n, heads, value_dim, dtype=torch.float32, device=DEVICE, gen=gen),
            "a": randn(n, heads, dtype=dtype, device=DEVICE, gen=gen),
            "beta": randn(n, heads, dtype=torch.float32, device=DEVICE, gen=gen).sigmoid(),
        }

    def run(pool, i, rows):
        m = meta(rows, len(i["q"]))
        return gated_delta_scan.gated_delta_scan(pool, i["q"], i["k"], i["v"], i["a"], i["beta"], neg_a, dt_bias, m, 8)

    def reference(pool, i, rows):
        q, k, v, beta = (i[name].double() for name in ("q", "k", "v", "beta"))
        return recurrent_scan.gated_delta_scan(pool, q, k, v, i["a"], beta, neg_a.double(), dt_bias.double(), rows)

    pool = randn(POOL, heads, key_dim, value_dim, dtype=torch.float32, device=DEVICE, gen=gen, scale=0.3)
    return Case(pool, rows_of, run, reference)


def kda_case(gen: torch.Generator) -> Case:
    """Kimi delta attention: float32 inputs, log-decays per key channel (Dk 12: a masked key tile)."""
    heads, key_dim, value_dim = 2, 12, 20

    def rows_of(n: int) -> dict[str, torch.Tensor]:
        k = F.normalize(randn(n, heads, key_dim, dtype=torch.float32, device=DEVICE, gen=gen), dim=-1)
        q = F.normalize(randn(n, heads, key_dim, dtype=torch.float32, device=DEVICE, gen=gen), dim=-1)
        return {
            "q": q * key_dim**-0.5,
            "k": k,
            "v": randn(n, heads, value_dim, dtype=torch.float32, device=DEVICE, gen=gen),
            "g": -randn(n, heads, key_dim, dtype=torch.float32, device=DEVICE, gen=gen).abs(),
            "beta": randn(n, heads, dtype=torch.float32, device=DEVICE, gen=gen).sigmoid(),
        }

    def run(pool, i, rows):
        m = meta(rows, len(i["q"]))
        return kda_scan.kda_scan(pool, i["q"], i["k"], i["v"], i["g"], i["beta"], m, 8)

    def reference(pool, i, rows):
        q, k, v, g, beta = (i[name].double() for name in ("q", "k", "v", "g", "beta"))
        return recurrent_scan.kda_scan(pool, q, k, v, g, beta, rows)

    pool = randn(POOL, heads, key_dim, value_dim, dtype=torch.float32, device=DEVICE, gen=gen, scale=0.3)
    return Case(pool, rows_of, run, reference)


def mamba2_case(gen: torch.Generator, dtype: torch.dtype, limit: tuple[float, float] = (0.0, float("inf"))) -> Case:
    heads, groups, head_dim, state_size = 4, 2, 12, 16
    dt_bias = randn(heads, dtype=dtype, device=DEVICE, gen=gen)
    a = -randn(heads, dtype=torch.float32, device=DEVICE, gen=gen, scale=0.5).exp()
    d = randn(heads, dtype=torch.float32, device=DEVICE, gen=gen)

    def grouped(n: int) -> torch.Tensor:  # B and C per group, repeated over the group's heads
        values = randn(n, groups, state_size, dtype=torch.float32, device=DEVICE, gen=gen)
        return values.repeat_interleave(heads // groups, dim=1)

    def rows_of(n: int) -> dict[str, torch.Tensor]:
        return {
            "x": randn(n, heads, head_dim, dtype=torch.float32, device=DEVICE, gen=gen),
            "b": grouped(n),
            "c": grouped(n),
            "dt": randn(n, heads, dtype=dtype, device=DEVICE, gen=gen),
        }

    def run(pool, i, rows):
        m = meta(rows, len(i["x"]))
        return mamba2_scan.mamba2_scan(pool, i["x"], i["b"], i["c"], i["dt"], dt_bias, a, d, limit, m, 8)

    def reference(pool, i, rows):
        x, b, c = (i[name].double() for name in ("x", "b", "c"))
        return recurrent_scan.mamba2_scan(pool, x, b, c, i["dt"], dt_bias, a.double(), d.double(), limit, rows)

    pool = randn(POOL, heads, head_dim, state_size, dtype=torch.float32, device=DEVICE, gen=gen)
    return Case(pool, rows_of, run, reference)


def reference_pool(case: Case) -> torch.Tensor:
    """A copy of the pool for the reference: float64 states, conv histories as they are."""
    return case.pool.clone() if case.copies_inputs else case.pool.double()


def check_against_reference(case: Case, tolerance_dtype: torch.dtype) -> None:
    """The step's outputs and every slot (running and captured) against the reference; idle slots untouched."""
    rows = scan_rows(LENGTHS, SLOTS, CAPTURES)
    inputs = case.rows_of(sum(LENGTHS))
    pool, ref_pool = case.pool.clone(), reference_pool(case)
    out = case.run(pool, inputs, rows)
    ref = case.reference(ref_pool, inputs, rows)
    assert_close(out, ref, tolerance_dtype)
    if case.copies_inputs:
        assert torch.equal(pool, ref_pool)
    else:
        assert_close(pool, ref_pool, tolerance_dtype, "state slots")
    assert torch.equal(pool[6], case.pool[6])  # the idle sequence's slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width, bias", [(4, True), (4, False), (2, True), (1, False)])
def test_causal_conv(dtype, width, bias):
    case = conv_case(case_generator("conv", dtype, width, bias), dtype, width, bias)
    check_against_reference(case, torch.float32)  # both sum float32 products in one order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta(dtype):
    check_against_reference(delta_case(case_generator("delta", dtype), dtype), torch.float32)


def test_kda():
    check_against_reference(kda_case(case_generator("kda")), torch.float32)


@pytest.mark.parametrize(
    "dtype, limit",
    [(torch.float32, (0.0, float("inf"))), (torch.float32, (0.05, 0.8)), (torch.bfloat16, (0.0, float("inf")))],
)
def test_mamba2(dtype, limit):
    # A bfloat16 time step is rounded twice (as transformers does): one rounding may land on either side.
    check_against_reference(mamba2_case(case_generator("mamba2", dtype, limit), dtype, limit), dtype)


CASES = {
    "conv": lambda gen: conv_case(gen, torch.bfloat16),
    "delta": lambda gen: delta_case(gen, torch.bfloat16),
    "kda": kda_case,
    "mamba2": lambda gen: mamba2_case(gen, torch.bfloat16),
}


def cat(*parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}


def part(inputs: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    return {name: t[rows] for name, t in inputs.items()}


@pytest.mark.parametrize("kernel", sorted(CASES))
def test_rows_are_batch_and_chunk_invariant(kernel):
    """Sequence A (6 rows, slot 2): alone, between two others with a capture after its row 1, and as 2 + 4
    rows in two calls (the second beside a decode row): same output and state bits; the capture equals the
    state after the first chunk."""
    case = CASES[kernel](case_generator("invariance", kernel))
    mine, before, after = case.rows_of(6), case.rows_of(3), case.rows_of(1)

    alone = case.pool.clone()
    out = case.run(alone, mine, scan_rows([6], [2]))

    batched = case.pool.clone()
    rows = scan_rows([3, 6, 1], [0, 2, 4], captures=((4, 5),))
    out_batched = case.run(batched, cat(before, mine, after), rows)
    assert torch.equal(out_batched[3:9], out)
    assert torch.equal(batched[2], alone[2])

    chunked = case.pool.clone()
    first = case.run(chunked, part(mine, slice(0, 2)), scan_rows([2], [2]))
    assert torch.equal(batched[5], chunked[2])  # the capture after row 1 is the state after two rows
    second = case.run(chunked, cat(after, part(mine, slice(2, 6))), scan_rows([1, 4], [4, 2]))
    assert torch.equal(torch.cat([first, second[1:]]), out)
    assert torch.equal(chunked[2], alone[2])
    assert (
        relative_error(out, case.reference(reference_pool(case), mine, scan_rows([6], [2]))) < TOLERANCE[torch.float32]
    )


@jit
def _softplus_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, softplus(tl.load(x_ptr + i, mask=i < n)), mask=i < n)


def test_softplus_matches_torch_at_every_scale():
    """Element by element: tiny tails (log1p, not log(1 + e)), the threshold at 20, no overflow above."""
    x = torch.tensor([-80.0, -30.0, -20.0, -5.0, -1e-3, 0.0, 1e-3, 0.5, 5.0, 19.9, 20.0, 20.1, 50.0, 100.0])
    out = torch.full_like(x, float("nan")).to(DEVICE)
    _softplus_kernel[(1,)](x.to(DEVICE), out, x.numel(), BLOCK=16)
    ref = F.softplus(x.double())
    assert ((out.cpu().double() - ref).abs() / ref).max() < 1e-6


def test_scan_meta_rejects_bad_rows():
    with pytest.raises(ValueError, match="outside"):
        build_scan_meta(scan_rows([2, 3], [0, 1]), 4, DEVICE)
    with pytest.raises(ValueError, match="capture at row"):
        build_scan_meta(scan_rows([2], [0], captures=((2, 3),)), 2, DEVICE)
    with pytest.raises(ValueError, match="runs in"):
        build_scan_meta(scan_rows([2, 1], [0, 1], captures=((0, 1),)), 3, DEVICE)


def test_scan_meta_layout():
    m = build_scan_meta(scan_rows(LENGTHS, SLOTS, CAPTURES), 14, DEVICE)
    assert m.starts.tolist() == [0, 5, 5, 6, 13] and m.ends.tolist() == [5, 5, 6, 13, 14]
    assert m.slots.tolist() == SLOTS
    offsets = m.capture_offsets.tolist()
    assert len(offsets) == 15 and offsets[0] == 0 and offsets[-1] == len(CAPTURES)
    found = {t: m.capture_slots.tolist()[offsets[t] : offsets[t + 1]] for t in range(14)}
    assert {t: s for t, s in found.items() if s} == {1: [7], 4: [8], 9: [9, 2], 13: [0]}

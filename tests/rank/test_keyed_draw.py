"""The vectorised keyed draw against the float64 reference (deployments/model_rank/keyed_reference.py), and
every way of taking a row's head, native and torch, against each other: the same token, bit for bit."""

import math

import pytest
import torch

from deployments.messages.step import PromptRowsWanted, SeqDraw, SeqStep, StepPlan
from deployments.model_rank import keyed_reference, rank_head
from deployments.model_rank.keyed_draw import draw_from_head
from deployments.model_rank.keyed_mass import FLOOR, MASS_CONSTANTS, fraction_bits, masses
from deployments.model_rank.sampler import prepare_draws, sample_rows
from deployments.model_rank.step_rows import prompt_logprob_rows
from kernels import cpu_native, cpu_sampling
from tests.support.kernel_levels import other_kernel_levels
from tests.support.keyed_rows import SETTINGS, keyed_draws, logit_rows

native = pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels are off here")


def _tokens(logits: torch.Tensor, draws: list[SeqDraw]) -> list[int]:
    return [r.token for r in sample_rows(logits, draws)]


@pytest.mark.parametrize("vocab", [50, 5000])
def test_the_vectorised_draw_is_the_float64_references_token(vocab: int) -> None:
    for seed in range(3):
        logits = logit_rows(vocab, seed)
        for index, settings in enumerate(SETTINGS):
            draws = keyed_draws(logits.shape[0], settings, seed * 100 + index)
            assert _tokens(logits, draws) == keyed_reference.draw_rows(logits, draws), settings


@pytest.mark.parametrize("level", ["auto", "torch"])
def test_the_vectorised_draw_is_the_references_token_on_a_152k_vocabulary(
    level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Natively and by torch's walk down the head (where the native kernels are off)."""
    monkeypatch.setenv("TENSORFOLD_KERNELS", level)
    logits = logit_rows(151_936, 9)[:6]  # the reference sorts a flat row whole: seconds
    for index, settings in enumerate([SETTINGS[1], SETTINGS[3], SETTINGS[9], dict(temperature=0.8, top_k=20)]):
        draws = keyed_draws(logits.shape[0], settings, index)
        assert _tokens(logits, draws) == keyed_reference.draw_rows(logits, draws), settings


def test_grammar_rows_draw_the_references_token() -> None:
    """Masks allowing many ids, one id, or none (a dead end: the row draws freely)."""
    logits = logit_rows(700, 4)
    words = (700 + 31) // 32
    gen = torch.Generator().manual_seed(8)
    half = torch.randint(-(2**31), 2**31 - 1, (words,), generator=gen, dtype=torch.int64).to(torch.int32)
    one = torch.zeros(words, dtype=torch.int32)
    one[3] = 1 << 5  # id 101 alone
    masks = [half, one, torch.zeros(words, dtype=torch.int32), half, one, half, None]
    for index, settings in enumerate([*SETTINGS, dict(temperature=0.0)]):
        draws = keyed_draws(len(masks), settings, index)
        for draw, mask in zip(draws, masks):
            draw.allowed = mask
        tokens = _tokens(logits, draws)
        assert tokens == keyed_reference.draw_rows(logits, draws), settings
        assert tokens[1] == tokens[4] == 101


def test_rows_where_nothing_weighs_take_their_lowest_allowed_id() -> None:
    nothing = torch.full((3, 40), float("-inf"))
    one = torch.zeros(2, dtype=torch.int32)
    one[1] = 0b1100  # ids 34 and 35
    for settings in [dict(temperature=0.0), dict(temperature=0.8, top_k=5), dict(temperature=1.0, top_p=0.5)]:
        draws = keyed_draws(3, settings, 1)
        draws[2].allowed = one
        assert _tokens(nothing, draws) == [0, 0, 34]


def test_nan_logits_weigh_nothing_in_a_sampled_row() -> None:
    logits = torch.tensor([[0.0, float("nan"), 30.0, float("nan"), 29.0]])
    drawn = {_tokens(logits, keyed_draws(1, dict(temperature=1.0), seed))[0] for seed in range(200)}
    assert drawn == {2, 4}


def test_every_head_of_the_rank_order_draws_the_same_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU's whole sorted row and its top-k set, the native draw at every kernel level this CPU runs, and
    torch's walk down the head on a CPU without them: heads of different widths, one token (tokens past
    any head's end weigh nothing)."""
    logits = torch.cat([logit_rows(4000, 2), logit_rows(4000, 3)])
    logits[3, 17] = float("nan")
    clean = torch.where(logits.isnan(), float("-inf"), logits)
    for index, settings in enumerate(SETTINGS):
        draws = keyed_draws(logits.shape[0], settings, index)
        inputs = prepare_draws(draws, logits.device).groups[0].settings  # every row sampled, none constrained
        assert inputs is not None
        bits = fraction_bits(logits.shape[-1])
        heads = [rank_head.sorted_rows(clean)]
        if inputs.top_k_max:
            heads.append(rank_head.top_of_rank(clean, inputs.top_k_max))
        tokens = [draw_from_head(ids, values, inputs, bits).tolist() for ids, values in heads]
        assert all(t == tokens[0] for t in tokens), settings
        for level in ["auto", *other_kernel_levels()]:  # the native draw at each level, then torch's walk
            monkeypatch.setenv("TENSORFOLD_KERNELS", level)
            assert _tokens(logits, draws) == tokens[0], (settings, level)


@native
def test_the_native_head_is_the_rank_orders_prefix() -> None:
    logits = logit_rows(3000, 5)
    full = rank_head.sorted_rows(logits)
    for top in [1, 5, 64, 65, 3000]:
        ids, values = cpu_sampling.rank_head(logits, top)
        assert torch.equal(ids, full[0][:, :top]) and torch.equal(values, full[1][:, :top])


@native
@pytest.mark.parametrize("level", ["auto", *other_kernel_levels()[:-1]])
def test_native_masses_are_torchs_bit_for_bit(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU kernel computes keyed_mass.masses' float64 ops in its order, at every native level: every y
    in the range, those at the reduction's half-way points and at the floor, several temperatures."""
    monkeypatch.setenv("TENSORFOLD_KERNELS", level)
    gen = torch.Generator().manual_seed(6)
    top = 11.25
    half_ways = top - torch.tensor([(k + 0.5) * math.log(2) for k in range(40)])
    near_floor = top + torch.linspace(FLOOR - 0.01, FLOOR + 0.01, 101)
    spread = top - torch.rand(40_000, generator=gen) * 40
    values = torch.cat([spread, half_ways, near_floor, torch.tensor([top, float("-inf")])]).to(torch.float32)
    for temperature in [0.05, 0.7, 1.0, 3.3]:
        for bits in [fraction_bits(50), fraction_bits(151_936), fraction_bits(600_000)]:
            t = torch.tensor([[temperature]], dtype=torch.float64)
            ours = masses(values.unsqueeze(0), torch.tensor([[top]]), t, bits)[0]
            theirs = cpu_sampling.keyed_masses(values, top, temperature, bits, MASS_CONSTANTS)
            assert torch.equal(ours, theirs), (temperature, bits)


def test_masses_are_the_weights_rounded_to_units() -> None:
    """Within half a unit (and a hair) of exp(y) 2^K: the polynomial's error is far below a unit."""
    values = torch.linspace(-26.0, 0.0, 5001, dtype=torch.float32)
    bits = fraction_bits(151_936)
    got = masses(values.unsqueeze(0), torch.tensor([[0.0]]), torch.tensor([[1.0]], dtype=torch.float64), bits)[0]
    for value, mass in zip(values.tolist(), got.tolist()):
        exact = math.exp(value) * 2.0**bits if value >= FLOOR else 0.0
        assert abs(mass - exact) <= 0.5 + 1e-3 * max(1.0, exact * 2.0**-40), value


def test_logprob_and_prompt_rows_are_the_references() -> None:
    logits = logit_rows(3000, 7)
    draws = keyed_draws(logits.shape[0], dict(temperature=0.9, top_k=30), 3, want_logprobs=6)
    results = sample_rows(logits, draws)
    for row, result in enumerate(results):
        assert result.logprobs == keyed_reference.logprob_row(logits[row], result.token, 6)
    next_ids = [5, 17, 2999, 8, 9, 10, 11]
    seq = SeqStep(list(range(7)), 0, [0], prompt_rows=PromptRowsWanted(top=4, first=0, next_ids=next_ids))
    rows = prompt_logprob_rows(StepPlan("prefill", [seq]), lambda first, count: logits[first : first + count])
    assert rows == {0: keyed_reference.prompt_rows(logits, next_ids, 4)}

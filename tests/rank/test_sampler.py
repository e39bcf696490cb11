"""Keyed sampling: a pure function of (seed, position, logits), with SGLang's cut order."""

import pytest
import torch

from deployments.messages.step import SeqDraw
from deployments.model_rank import ranked_draw
from deployments.model_rank.ranked_draw import filtered_distribution
from deployments.model_rank.sampler import derive_seed, draw_token, keyed_uniform, sample_rows


def _draw(**kw: float) -> SeqDraw:
    base = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=7, reply_position=0)
    base.update(kw)
    return SeqDraw(**base)  # type: ignore[arg-type]


def test_keyed_uniform_is_stable_and_spread() -> None:
    values = [keyed_uniform(123, i) for i in range(2000)]
    assert values == [keyed_uniform(123, i) for i in range(2000)]
    assert 0.45 < sum(values) / len(values) < 0.55
    assert keyed_uniform(1, 0) != keyed_uniform(2, 0)


def test_draw_depends_only_on_seed_position_and_row() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    draws = [_draw(seed=11, reply_position=p, temperature=0.8) for p in range(4)]
    batched = [r.token for r in sample_rows(logits, draws)]
    solo = [draw_token(logits[i], draws[i]) for i in range(4)]
    reversed_rows = [r.token for r in sample_rows(logits.flip(0), draws[::-1])][::-1]
    assert batched == solo == reversed_rows


def test_greedy_takes_lowest_id_on_ties() -> None:
    logits = torch.tensor([0.0, 3.0, 3.0, 1.0])
    assert draw_token(logits, _draw(temperature=0.0)) == 1


def test_top_k_top_p_min_p_cuts_in_order() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = probs.log()
    ids, kept = filtered_distribution(logits, _draw(top_k=3))
    assert ids.tolist() == [0, 1, 2]
    ids, kept = filtered_distribution(logits, _draw(top_p=0.7))
    assert ids.tolist() == [0, 1]  # 0.5 < 0.7, then 0.75 reaches it
    # min_p is relative to the likeliest token: 0.4 * 0.5 = 0.2 keeps 0 and 1.
    ids, kept = filtered_distribution(logits, _draw(min_p=0.4))
    assert ids.tolist() == [0, 1]
    assert torch.isclose(kept.sum(), torch.tensor(1.0, dtype=kept.dtype))


def test_sampled_frequencies_follow_the_distribution() -> None:
    logits = torch.tensor([0.7, 0.2, 0.1]).log()
    counts = [0, 0, 0]
    for position in range(3000):
        counts[draw_token(logits, _draw(reply_position=position))] += 1
    assert abs(counts[0] / 3000 - 0.7) < 0.04 and abs(counts[2] / 3000 - 0.1) < 0.03


def test_derived_seed_follows_prompt_and_salt() -> None:
    assert derive_seed([1, 2, 3]) == derive_seed([1, 2, 3])
    assert derive_seed([1, 2, 3]) != derive_seed([1, 2, 4])
    assert derive_seed([1, 2, 3], salt=5) != derive_seed([1, 2, 3])


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.7),
        dict(temperature=1.0, top_p=0.9),
        dict(temperature=0.5, top_p=0.95, top_k=50),
        dict(temperature=1.3, min_p=0.05),
        dict(temperature=1.0, top_k=3000),
    ],
)
def test_the_walk_over_the_head_draws_what_the_whole_order_draws(settings: dict, monkeypatch) -> None:
    """The draw reads the head of the rank order and widens it while it must: a token never depends on
    how far it read (flat rows reach deep, peaked ones stop in the head; ties and masked ids included)."""
    gen = torch.Generator().manual_seed(3)
    rows = []
    for trial in range(24):
        logits = torch.randn(5000, generator=gen) * (1 + trial % 4)
        if trial % 2:
            logits[:30] += 9  # a trained model's head
        if trial % 3 == 0:
            logits[100:4000] = float("-inf")  # a grammar mask
        if trial % 8 == 5:
            logits[20:] = float("-inf")  # a grammar that allows fewer tokens than the first head holds
        logits[7:12] = logits[7]  # ties, resolved by lower id
        rows.append(logits)
    draws = [_draw(seed=trial, reply_position=trial * 5, **settings) for trial in range(24)]
    from_head = [draw_token(row, draw) for row, draw in zip(rows, draws)]
    monkeypatch.setattr(ranked_draw, "CANDIDATES", 5000)
    assert [draw_token(row, draw) for row, draw in zip(rows, draws)] == from_head
    kept = [filtered_distribution(row, draw)[0].tolist() for row, draw in zip(rows, draws)]
    assert all(token in ids for token, ids in zip(from_head, kept))  # drawn from the kept set

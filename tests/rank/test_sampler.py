"""Keyed sampling: a pure function of (seed, position, logits), with SGLang's cut order."""

import torch

from deployments.messages.step import SeqDraw
from deployments.model_rank.sampler import derive_seed, keyed_uniform, sample_rows


def _draw(**kw: float) -> SeqDraw:
    base = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=7, reply_position=0)
    base.update(kw)
    return SeqDraw(**base)  # type: ignore[arg-type]


def _tokens(logits: torch.Tensor, draws: list[SeqDraw]) -> list[int]:
    return [r.token for r in sample_rows(logits, draws)]


def _drawn_set(logits: torch.Tensor, positions: int, **settings: float) -> set[int]:
    """The tokens one row draws over many reply positions."""
    draws = [_draw(reply_position=p, **settings) for p in range(positions)]
    return set(_tokens(logits.repeat(positions, 1), draws))


def test_keyed_uniform_is_stable_and_spread() -> None:
    values = [keyed_uniform(123, i) for i in range(2000)]
    assert values == [keyed_uniform(123, i) for i in range(2000)]
    assert 0.45 < sum(values) / len(values) < 0.55
    assert keyed_uniform(1, 0) != keyed_uniform(2, 0)


def test_draw_depends_only_on_seed_position_and_row() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    draws = [_draw(seed=11, reply_position=p, temperature=0.8) for p in range(4)]
    batched = _tokens(logits, draws)
    solo = [_tokens(logits[i : i + 1], [draws[i]])[0] for i in range(4)]
    reversed_rows = _tokens(logits.flip(0), draws[::-1])[::-1]
    assert batched == solo == reversed_rows


def test_greedy_takes_lowest_id_on_ties() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0]])
    assert _tokens(logits, [_draw(temperature=0.0)]) == [1]


def test_top_k_top_p_min_p_cuts_in_order() -> None:
    logits = torch.tensor([[0.5, 0.25, 0.15, 0.1]]).log()
    assert _drawn_set(logits, 400, top_k=3) == {0, 1, 2}
    assert _drawn_set(logits, 400, top_p=0.7) == {0, 1}  # 0.5 < 0.7, then 0.75 reaches it
    # min_p is relative to the likeliest token: 0.4 * 0.5 = 0.2 keeps 0 and 1.
    assert _drawn_set(logits, 400, min_p=0.4) == {0, 1}
    # top-p reads the temperature distribution: 0.5, 0.25, 0.15, 0.1 at T = 1 keep three tokens for 0.8
    # (0.75 < 0.8); at T = 0.5 they are 0.725, 0.181, 0.065, 0.029, and 0.906 >= 0.8 after two.
    assert _drawn_set(logits, 400, top_p=0.8) == {0, 1, 2}
    assert _drawn_set(logits, 400, temperature=0.5, top_p=0.8) == {0, 1}


def test_sampled_frequencies_follow_the_distribution() -> None:
    logits = torch.tensor([[0.7, 0.2, 0.1]]).log()
    draws = [_draw(reply_position=position) for position in range(3000)]
    tokens = _tokens(logits.repeat(3000, 1), draws)
    counts = [tokens.count(t) for t in range(3)]
    assert abs(counts[0] / 3000 - 0.7) < 0.04 and abs(counts[2] / 3000 - 0.1) < 0.03


def test_derived_seed_follows_prompt_and_salt() -> None:
    assert derive_seed([1, 2, 3]) == derive_seed([1, 2, 3])
    assert derive_seed([1, 2, 3]) != derive_seed([1, 2, 4])
    assert derive_seed([1, 2, 3], salt=5) != derive_seed([1, 2, 3])


def test_logprob_rows_and_scores_describe_the_raw_distribution_whatever_the_settings() -> None:
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(4))
    logits[:, 10:14] = logits[0, 10]  # ties among the best: lower ids first
    logits[:, 10:14] += 8
    raw = torch.log_softmax(logits.to(torch.float64), dim=-1)
    draws = [
        _draw(temperature=0.0, want_logprobs=5, score_ids=[3, 12]),
        _draw(temperature=0.7, top_k=2, want_logprobs=5),
        _draw(temperature=1.2, top_p=0.5, score_ids=[299]),
    ]
    results = sample_rows(logits, draws)
    for row, result in enumerate(results[:2]):
        assert result.logprobs is not None and result.logprobs.token_id == result.token
        assert result.logprobs.logprob == float(raw[row, result.token])
        assert [t for t, _ in result.logprobs.top][:4] == [10, 11, 12, 13]
        assert [v for _, v in result.logprobs.top] == [float(raw[row, t]) for t, _ in result.logprobs.top]
    assert results[0].scores == [float(raw[0, 3]), float(raw[0, 12])]
    assert results[2].scores == [float(raw[2, 299])] and results[2].logprobs is None
    assert results[1].scores is None

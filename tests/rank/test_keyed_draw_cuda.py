"""The keyed draw on a CUDA device (skipped without one): the CPU's tokens bit for bit, and a step that
waits on the device only for its one read back."""

import pytest
import torch

from deployments.model_rank.host_reads import HostReads
from deployments.model_rank.sampler import prepare_draws, sample_rows, start_draws
from tests.support.keyed_rows import SETTINGS, keyed_draws, logit_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("vocab", [50, 5000, 151_936])
def test_the_device_draws_the_cpus_tokens_bit_for_bit(vocab: int) -> None:
    for seed in range(2):
        logits = logit_rows(vocab, seed)
        for index, settings in enumerate([*SETTINGS, dict(temperature=0.0)]):
            draws = keyed_draws(logits.shape[0], settings, seed * 100 + index)
            on_device = [r.token for r in sample_rows(logits.to(CUDA), draws)]
            assert on_device == [r.token for r in sample_rows(logits, draws)], settings


def test_grammar_rows_on_the_device_draw_the_cpus_tokens() -> None:
    logits = logit_rows(700, 4)
    words = torch.randint(-(2**31), 2**31 - 1, (logits.shape[0], 22), dtype=torch.int64).to(torch.int32)
    words[1] = 0  # a dead end draws freely
    for settings in [SETTINGS[0], SETTINGS[9], dict(temperature=0.0)]:
        draws = keyed_draws(logits.shape[0], settings, 5)
        for draw, mask in zip(draws, words):
            draw.allowed = mask
        on_device = [r.token for r in sample_rows(logits.to(CUDA), draws)]
        assert on_device == [r.token for r in sample_rows(logits, draws)], settings


def test_a_step_waits_on_the_device_only_to_read_its_results() -> None:
    logits = logit_rows(151_936, 3).to(CUDA)
    draws = keyed_draws(logits.shape[0], SETTINGS[1], 2, want_logprobs=5, score_ids=[3, 4])
    draws[0].temperature = 0.0
    inputs = prepare_draws(draws, CUDA)
    torch.cuda.synchronize()
    reads = HostReads()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = start_draws(logits, inputs, reads)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    reads.fetch()
    results = pending.results()
    assert [r.token for r in results] == [r.token for r in sample_rows(logits.cpu(), draws)]
    assert all(r.logprobs is not None and len(r.logprobs.top) == 5 and r.scores is not None for r in results)


def test_logprob_rows_on_the_device_are_the_cpus_to_rounding() -> None:
    logits = logit_rows(5000, 6)
    draws = keyed_draws(logits.shape[0], dict(temperature=0.0), 1, want_logprobs=8)
    device, host = sample_rows(logits.to(CUDA), draws), sample_rows(logits, draws)
    for ours, theirs in zip(device, host):
        assert ours.logprobs is not None and theirs.logprobs is not None
        assert [t for t, _ in ours.logprobs.top] == [t for t, _ in theirs.logprobs.top]
        assert ours.logprobs.logprob == pytest.approx(theirs.logprobs.logprob, abs=1e-12)

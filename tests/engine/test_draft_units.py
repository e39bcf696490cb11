"""The drafters and the draft bookkeeping on their own: n-gram lookup, draft lengths, grammar walk-back,
KV rollback after a rejected draft, and the MTP chain against a hand-run reference."""

import json

import pytest
import torch

from deployments.config import EngineConfig
from deployments.messages.engine_process import Inbox
from deployments.messages.requests import EngineRequest, GrammarSpec, SamplingParams
from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.models import load_model
from deployments.scheduler.engine.core import Engine
from deployments.scheduler.engine.drafts import MtpCost, NgramIndex, RoundCosts, StepCost, choose_lengths
from serve_app.args import resolve_model_dir
from tests.support.model_harness import PagedHarness


def test_ngram_index_proposes_what_followed_the_longest_latest_match() -> None:
    index = NgramIndex()
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7]
    assert index.propose(tokens, 3) == []  # the suffix (6, 7) never occurred before
    tokens += [1, 2, 3, 4]
    # (1, 2, 3, 4) occurred at the start, followed by 5 9 2; (2, 3, 4) occurred later, but the longer wins.
    assert index.propose(tokens, 3) == [5, 9, 2]
    tokens += [6]
    assert index.propose(tokens, 2) == [7, 1]  # (3, 4, 6) -> what followed it
    assert index.propose([8], 4) == [] and NgramIndex().propose([5, 5, 5, 5], 2) == [5]


def test_ngram_index_catches_up_incrementally_like_a_fresh_one() -> None:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (300,), generator=gen).tolist()
    live = NgramIndex()
    for end in range(2, len(tokens)):
        assert live.propose(tokens[:end], 4) == NgramIndex().propose(tokens[:end], 4), end


def test_choose_lengths_drafts_while_it_pays() -> None:
    # Rows nearly free (a GPU, or a model whose step is all fixed cost): every good draft is worth it.
    assert choose_lengths([0.9, 0.9], [4, 4], RoundCosts(fixed=0.03, per_row=0.0001)) == [4, 4]
    # Rows as costly as the fixed part: only very likely drafts pay, and none from a poor drafter.
    assert choose_lengths([0.1, 0.1], [4, 4], RoundCosts(fixed=0.01, per_row=0.01)) == [0, 0]
    lengths = choose_lengths([0.95, 0.3], [4, 4], RoundCosts(fixed=0.02, per_row=0.004))
    assert lengths[0] > lengths[1] >= 0
    assert choose_lengths([0.99], [2], RoundCosts(fixed=0.01, per_row=0.0)) == [2]  # never past the proposal


def _mtp_cost(pass_seconds: float) -> MtpCost:
    cost = MtpCost()
    for rows in (1, 4, 16, 64):
        cost.record(rows, pass_seconds)
    return cost


def test_choose_lengths_weighs_the_mtp_layers_passes() -> None:
    cheap = RoundCosts(fixed=0.05, per_row=0.0005, mtp=_mtp_cost(0.0005))  # a deep trunk: the layer is ~1%
    assert choose_lengths([0.9] * 4, [3] * 4, cheap) == [3] * 4
    costly = RoundCosts(fixed=0.002, per_row=0.0001, mtp=_mtp_cost(0.004))  # a chained draft costs 2 steps
    assert choose_lengths([0.9] * 16, [3] * 16, costly) == [1] * 16  # the first draft comes with the cache pass
    assert choose_lengths([0.9] * 16, [3] * 16, RoundCosts(fixed=0.002, per_row=0.0001)) == [3] * 16  # n-gram


def test_step_cost_fits_fixed_and_per_row_seconds() -> None:
    cost = StepCost()
    assert cost.fit()[1] > 0  # a prior before any step
    for rows in (1, 4, 8, 16, 2, 9):
        cost.record(rows, 0.010 + 0.002 * rows)
    fixed, per_row = cost.fit()
    assert fixed == pytest.approx(0.010) and per_row == pytest.approx(0.002)
    flat = StepCost()
    for _ in range(5):
        flat.record(3, 0.02)  # one row count only: the slope falls back to a share of the step
    fixed, per_row = flat.fit()
    assert fixed > 0 and 0 < per_row < 0.02 and fixed + 3 * per_row == pytest.approx(0.02)


def test_mtp_cost_keeps_a_mean_per_width() -> None:
    cost = MtpCost()
    assert cost.pass_seconds(4, step_seconds=0.01) == 0.005  # before any pass: half a plain step
    cost.record(1, 0.001)
    cost.record(16, 0.003)
    cost.record(17, 0.004)  # the same bucket as 16: its mean
    assert cost.pass_seconds(1, 0.01) == 0.001 and cost.pass_seconds(20, 0.01) == pytest.approx(0.0035, rel=0.02)
    assert cost.pass_seconds(2, 0.01) == 0.001  # an unseen width takes the nearest bucket's
    assert cost.pass_seconds(0, 0.01) == 0.0


@pytest.fixture(scope="module")
def tiny_glm_engine() -> Engine:
    model = str(resolve_model_dir("builtin:tiny-glm"))
    return Engine(
        EngineConfig(model=model, kv_cache_gib=0.01, parallel=4, draft="mtp", engine_threads=1, draft_policy="fixed")
    )


def test_grammar_cuts_drafts_and_stands_where_it_was(tiny_glm_engine: Engine) -> None:
    engine = tiny_glm_engine
    tokenizer = engine.tokenizer
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    engine.add_request(EngineRequest("g", tokenizer.encode("x"), grammar=spec, max_tokens=20, draft=True))
    seq = engine.requests.get("g")
    assert seq is not None
    good = tokenizer.encode('{"a": 1')
    before = seq.grammar.checkpoint()
    mask_before = seq.next_draw().allowed
    first, kept, draws = seq.verify_draws(good + tokenizer.encode("zz"))
    assert kept == good  # the grammar refuses "zz" after {"a": 1, so drafts end there
    assert [d.reply_position for d in draws] == list(range(1, len(good) + 1))
    assert seq.grammar.checkpoint() == before and torch.equal(seq.next_draw().allowed, mask_before)
    assert torch.equal(first.allowed, mask_before)
    engine.run_once(Inbox(aborts=["g"]))


def test_rejected_drafts_leave_no_kv_or_cached_block_behind(tiny_glm_engine: Engine) -> None:
    """After every verify round, exactly the written tokens but the last are computed, and the prefix cache
    holds only blocks of them: a rejected draft's slot is overwritten by the next round."""
    engine = tiny_glm_engine
    prompt = [(37 * i) % 700 + 10 for i in range(21)]  # no script: the model is unsure, drafts miss
    request = EngineRequest(
        "kv", prompt, sampling=SamplingParams(temperature=1.5, seed=3, ignore_eos=True), max_tokens=60
    )
    engine.add_request(request)
    seq = engine.requests.get("kv")
    assert seq is not None
    drafted = 0
    while seq.finish_reason is None:
        engine.run_once(Inbox())
        if seq.finish_reason is None and seq.num_reply_tokens:
            assert seq.num_computed == len(seq.token_ids) - 1
            full = seq.num_computed // engine.config.block_size
            assert len(engine.blocks.resident_chain(seq.block_table)) <= full
            drafted = seq.stats.drafted
    assert seq.stats.drafted > seq.stats.accepted  # hot sampling off the script rejects some
    assert drafted > 0


def test_mtp_chain_matches_a_hand_run_chain() -> None:
    """The rank's proposals: the MTP layer over the step's rows, then chained on its own residual."""
    from deployments.messages.step import SeqDraw, SeqStep, StepPlan
    from deployments.model_rank.runner import ModelRunner

    path = str(resolve_model_dir("builtin:tiny-glm"))
    runner = ModelRunner(path, "float32", "cpu", ParallelContext(), mtp=True)
    runner.allocate_kv(16, 16)
    prompt = [719, 720, 722, 336, 723, 726, 300, 301, 302]
    draw = SeqDraw(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0, reply_position=0)
    step = SeqStep(new_token_ids=prompt, num_computed=0, block_ids=[0, 1], draw=draw, mtp=True, propose=3)
    output = runner.execute(StepPlan(kind="prefill", seqs=[step]))
    drawn = output.draws[0].token
    proposal = output.proposals[0]
    assert (proposal.after, proposal.last_token, len(proposal.token_ids)) == (len(prompt), drawn, 3)

    model = load_model(path, dtype="float32")
    harness = PagedHarness(model, num_blocks=16)
    model.bind_mtp_kv_caches(harness.allocate(model.mtp_kv_cache_specs()))
    batch = harness.batch([(0, prompt)], all_logits=True)
    residual = model.mtp.residual(model(batch), torch.tensor(prompt[1:] + [drawn]), batch)
    expected = [int(model.mtp.greedy_drafts(residual[-1:])[0])]
    state = residual[-1:]
    for k in range(1, 3):  # draft k + 1 from the MTP row at the position of draft k - 1 (the drawn token first)
        chain = harness.batch([(0, [expected[-1]])])  # position len(prompt) + k - 1, the harness's next slot
        state = model.mtp.residual(state, torch.tensor([expected[-1]]), chain)
        expected.append(int(model.mtp.greedy_drafts(state)[0]))
    assert proposal.token_ids == expected

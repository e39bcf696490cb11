"""The MLX rank on the hybrid families (HYBRID_ARCHS) and the sparse-attention ones (DSA_ARCHS: GLM-5.3's
indexer and shared layers, GLM-5.3-Flash's k-pools, KDA and hyper-connections): logits and greedy ids equal
the torch rank's, rows are bitwise the same solo, batched, chunked and verified, captured and copied states
resume bitwise, the runner's slot copies honour the scheduler's plan, and Nemotron-H's MTP step drafts as
torch's does. Linux runs MLX's CPU build; a Mac runs the same code on Metal."""

from pathlib import Path

import pytest
import torch

from deployments.messages.step import ZERO_STATE, SeqDraw, SeqStep, StepPlan, StepResult
from deployments.model_rank.models import load_model
from serve_app.fixtures.archs import DSA_ARCHS, HYBRID_ARCHS
from serve_app.fixtures.checkpoints import build_random_checkpoint
from tests.rank.test_model_parity import VARIANTS
from tests.support.model_harness import PagedHarness

mx = pytest.importorskip("mlx.core")
from deployments.model_rank.mlx_rank.runner import MlxRunner  # noqa: E402
from tests.support.mlx_harness import MlxHarness  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 48, 12
FLOAT32_TOLERANCE = 1e-4  # the torch rank's own float32 bound against transformers (test_model_parity.py)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/rank/conftest.py


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mlx-hybrid")
    return {arch: build_random_checkpoint(arch, root / arch) for arch in HYBRID_ARCHS + DSA_ARCHS}


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(2, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.mark.parametrize("arch", HYBRID_ARCHS + DSA_ARCHS)
def test_logits_and_greedy_match_the_torch_rank(arch: str, checkpoints: dict[str, Path], prompt: list[int]) -> None:
    model = load_model(checkpoints[arch], dtype="float32")
    runner = MlxRunner(checkpoints[arch], "float32")
    expected = PagedHarness(model).step([(0, prompt)], all_logits=True)  # [48, V]
    ours = MlxHarness(runner).step([(0, prompt)], all_logits=True)
    assert (ours - expected).abs().max().item() < FLOAT32_TOLERANCE
    greedy = PagedHarness(model).generate(0, prompt, NEW_TOKENS)
    assert MlxHarness(runner).generate(0, prompt, NEW_TOKENS) == greedy
    assert MlxHarness(runner).generate(0, prompt, NEW_TOKENS, chunk=7) == greedy


HYBRID_VARIANTS = [name for name, (arch, _) in VARIANTS.items() if arch in HYBRID_ARCHS]


@pytest.mark.parametrize("variant", HYBRID_VARIANTS)
def test_config_variants_match_the_torch_rank(variant: str, tmp_path: Path, prompt: list[int]) -> None:
    """tests/rank/test_model_parity.py's hybrid variants: one value head per key head and three, a 2-tap
    conv, biased attention, attention first, no latent MoE, one B/C group, every Mamba2 and MLP bias."""
    arch, overrides = VARIANTS[variant]
    path = build_random_checkpoint(arch, tmp_path / variant, seed=3, **overrides)
    expected = PagedHarness(load_model(path, dtype="float32")).step([(0, prompt)], all_logits=True)
    ours = MlxHarness(MlxRunner(path, "float32")).step([(0, prompt)], all_logits=True)
    assert (ours - expected).abs().max().item() < FLOAT32_TOLERANCE


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", HYBRID_ARCHS + DSA_ARCHS)
def test_rows_are_the_same_solo_batched_and_chunked(
    arch: str, dtype: str, checkpoints: dict[str, Path], prompt: list[int]
) -> None:
    """The last prompt row bitwise equal whole, in chunks of 1 and 7, and beside other sequences' rows."""
    runner = MlxRunner(checkpoints[arch], dtype)
    whole = MlxHarness(runner).prefill(0, prompt)
    for chunk in (1, 7):
        assert torch.equal(MlxHarness(runner).prefill(0, prompt, chunk=chunk), whole), f"chunks of {chunk}"
    gen = torch.Generator().manual_seed(1)
    others = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (3, 29, 40)]
    harness = MlxHarness(runner)
    harness.step([(1, others[0]), (2, others[1][:10])])
    harness.step([(1, [5]), (0, prompt[:30]), (2, others[1][10:]), (3, others[2])])
    batched = harness.step([(3, [7]), (2, [9]), (0, prompt[30:]), (1, [11])])  # decodes around a prefill chunk
    assert torch.equal(batched[2], whole)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe", "nemotron_h", *DSA_ARCHS])
def test_verify_rows_equal_serial_decode_rows(arch: str, checkpoints: dict[str, Path], prompt: list[int]) -> None:
    """A verify round's rows are bitwise the rows serial decoding computes (bfloat16, beside other rows)."""
    runner = MlxRunner(checkpoints[arch], "bfloat16")
    continuation = [17, 301, 45, 9, 260]
    serial = MlxHarness(runner)
    serial.prefill(0, prompt)
    rows = torch.stack([serial.step([(0, [token])])[0] for token in continuation])  # [5, V], one step each
    mixed = MlxHarness(runner)
    mixed.step([(1, prompt[:9]), (0, prompt)])
    verified = mixed.step([(1, [3]), (0, continuation), (2, prompt[5:30])], all_logits=True)  # [1 + 5 + 25, V]
    assert torch.equal(verified[1:6], rows)


def _pools_equal(harness: MlxHarness, a: int, b: int) -> bool:
    return all(mx.array_equal(pool[a], pool[b]).item() for pools in harness.pools() for pool in pools)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", [*HYBRID_ARCHS, "glm5_next"])
def test_captured_states_resume_bit_identically(
    arch: str, dtype: str, checkpoints: dict[str, Path], prompt: list[int]
) -> None:
    """States captured after rows 15 and 31 of a prefill chunk (beside another sequence) continue exactly as
    the run that never stopped; a capture after the chunk's last row equals the slot's own advanced state."""
    runner = MlxRunner(checkpoints[arch], dtype)
    uncut = MlxHarness(runner).step([(0, prompt)], all_logits=True)  # [48, V]
    harness = MlxHarness(runner)
    at_16, at_32, at_40 = 13, 14, 15
    harness.step([(1, prompt[::-1][:23]), (0, prompt[:40])], captures=[[], [(15, at_16), (31, at_32), (39, at_40)]])
    assert _pools_equal(harness, at_40, harness.seqs[0].slot)
    assert torch.equal(harness.step([(0, prompt[40:])], all_logits=True), uncut[40:])
    harness.resume(2, source_id=0, length=32, slot=at_32)
    assert torch.equal(harness.step([(2, prompt[32:])], all_logits=True), uncut[32:])
    harness.resume(3, source_id=0, length=16, slot=at_16)
    for start in range(16, PROMPT_LEN, 7):  # in chunks of 7, beside sequence 1's decode
        rows = harness.step([(1, [7]), (3, prompt[start : start + 7])], all_logits=True)[1:]
        assert torch.equal(rows, uncut[start : start + 7])


def _greedy() -> SeqDraw:
    """Greedy, with the raw log-probabilities of the first 64 ids (what the rows are compared by)."""
    return SeqDraw(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0, reply_position=0, score_ids=list(range(64)))


@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h"])
def test_the_runner_copies_states_as_the_plan_says(arch: str, checkpoints: dict[str, Path], prompt: list[int]) -> None:
    """Through `execute`: a snapshot captured at a block boundary, copied into another slot (`state_from`),
    continues bitwise as the whole prompt does; a reused slot restarts from zeroed states (ZERO_STATE); the
    draws equal the torch rank's."""
    from deployments.model_rank.forward_batch import ParallelContext
    from deployments.model_rank.runner import ModelRunner

    def run(runner: MlxRunner | ModelRunner) -> list[StepResult]:
        runner.allocate_kv(16, 16, 6)
        whole = SeqStep(prompt, 0, [0, 1, 2], _greedy(), state_slot=0, state_from=ZERO_STATE, state_captures=[(15, 4)])
        drawn = runner.execute(StepPlan("prefill", [whole])).draws
        rest = SeqStep(prompt[16:], 16, [0, 3, 4], _greedy(), state_slot=1, state_from=4)
        drawn += runner.execute(StepPlan("prefill", [rest])).draws
        again = SeqStep(prompt[:20], 0, [5, 6], _greedy(), state_slot=0, state_from=ZERO_STATE)
        fresh = SeqStep(prompt[:20], 0, [7, 8], _greedy(), state_slot=2, state_from=ZERO_STATE)
        return drawn + runner.execute(StepPlan("prefill", [again, fresh])).draws

    ours = run(MlxRunner(checkpoints[arch], "float32"))
    assert ours[0] == ours[1] and ours[2] == ours[3]
    expected = run(ModelRunner(checkpoints[arch], "float32", "cpu", ParallelContext()))
    assert [r.token for r in ours] == [r.token for r in expected]
    for mine, theirs in zip(ours, expected):
        assert max(abs(a - b) for a, b in zip(mine.scores or [], theirs.scores or [])) < FLOAT32_TOLERANCE


def test_nemotron_mtp_step_drafts_as_the_torch_ranks(checkpoints: dict[str, Path], prompt: list[int]) -> None:
    """Nemotron-H's MTP step in MLX: its logits within the float32 bound of torch's, the same greedy drafts."""
    from deployments.model_rank.mlx_rank.arrays import to_torch

    path = checkpoints["nemotron_h"]
    tokens, following = prompt[:-1], prompt[1:]
    model = load_model(path, dtype="float32")
    harness = PagedHarness(model)
    batch = harness.batch([(0, tokens)], all_logits=True)
    model.bind_mtp_kv_caches(harness.allocate(model.mtp_kv_cache_specs()))
    expected = model.mtp.compute_logits(model.mtp(model(batch), torch.tensor(following), batch))
    runner = MlxRunner(path, "float32", mtp=True)
    assert runner.mtp is not None and runner.info().mtp
    mlx_harness = MlxHarness(runner)
    mlx_batch = mlx_harness.mlx_batch([(0, tokens)], all_logits=True)
    residual = runner.mtp.residual(runner.model(mlx_batch), mx.array(following, mx.int32), mlx_batch)
    ours = to_torch(runner.mtp.head(residual).astype(mx.float32))
    assert (ours - expected).abs().max().item() < FLOAT32_TOLERANCE
    assert runner.mtp.greedy(residual).tolist() == expected.argmax(-1).tolist()

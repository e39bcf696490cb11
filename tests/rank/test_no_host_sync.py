"""No host sync in the forward pass: a decode step's forward on the CUDA path (Triton, interpreted on CPU) makes
no call that would stall the host behind a GPU, for a dense, an MoE, a hybrid and an MTP-drafting model, and
the drafter reads its chained drafts once (tests/support/sync_guard.py says what counts as a sync)."""

from collections.abc import Callable
from pathlib import Path

import pytest

from kernels.testing import kernel_test_device

DEVICE = kernel_test_device()  # turns the interpreter on before Triton is imported
pytest.importorskip("triton", reason="the CUDA path runs in Triton's interpreter here", exc_type=ImportError)

import torch  # noqa: E402

from deployments.messages.step import ZERO_STATE, SeqDraw, SeqStep, StepOutput, StepPlan  # noqa: E402
from deployments.model_rank.forward_batch import ForwardBatch, ParallelContext  # noqa: E402
from deployments.model_rank.runner import ModelRunner  # noqa: E402
from kernels import dispatch  # noqa: E402
from serve_app.fixtures.checkpoints import build_random_checkpoint  # noqa: E402
from tests.support.sync_guard import no_host_sync  # noqa: E402

STAGING = ("deployments.model_rank.step_upload",)  # pinned host buffers by design (non-blocking copies)
PROMPTS = [[5, 9, 14, 3, 22], [7, 31, 2]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("no-sync")
    return {arch: build_random_checkpoint(arch, root / arch) for arch in ("qwen3", "glm4_moe_lite", "nemotron_h")}


@pytest.fixture
def no_lazy_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' metadata must come with the batch, not from the first layer that needs it."""

    def built_in_a_layer(*args, **kwargs):
        raise AssertionError("a layer built the step's metadata (and copied it to the device) itself")

    monkeypatch.setattr(dispatch, "build_paged_meta", built_in_a_layer)
    monkeypatch.setattr(dispatch, "build_scan_meta", built_in_a_layer)


def _draw(position: int) -> SeqDraw:
    return SeqDraw(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=1, reply_position=position)


def _runner(checkpoint: Path, mtp: bool = False) -> ModelRunner:
    runner = ModelRunner(checkpoint, "float32", "cpu", ParallelContext(), mtp=mtp)
    runner.allocate_kv(32, 16, 8 if runner.state_specs else 0)
    return runner


def _step(prompts: list[list[int]], computed: list[int], hybrid: bool, **seq) -> StepPlan:
    """One step of every sequence: sequence i owns block i and state slot i."""
    return StepPlan(
        "decode" if any(computed) else "prefill",
        [
            SeqStep(
                new_token_ids=tokens,
                num_computed=done,
                block_ids=[index],
                draw=_draw(0),
                state_slot=index if hybrid else -1,
                state_from=ZERO_STATE if hybrid and not done else None,
                **seq,
            )
            for index, (tokens, done) in enumerate(zip(prompts, computed))
        ],
    )


def _guarded(forward: Callable[[ForwardBatch], torch.Tensor], calls: list[int]) -> Callable:
    def run(batch: ForwardBatch) -> torch.Tensor:
        calls.append(len(batch.query_lens))
        with no_host_sync():
            return forward(batch)

    return run


def _decode_after_prefill(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch, guard: Callable[[], None] = lambda: None, **seq
) -> StepOutput:
    """Prefill on the torch path, then one decode step on the Triton path with its forward guarded (and
    whatever else `guard` guards)."""
    hybrid = bool(runner.state_specs)
    monkeypatch.setenv("TENSORFOLD_KERNELS", "torch")
    drawn = runner.execute(_step(PROMPTS, [0, 0], hybrid, **seq)).draws
    monkeypatch.setenv("TENSORFOLD_KERNELS", "triton")
    guard()
    calls: list[int] = []
    monkeypatch.setattr(runner.model, "forward", _guarded(runner.model.forward, calls))
    plan = _step([[d.token] for d in drawn], [len(p) for p in PROMPTS], hybrid, **seq)
    output = runner.execute(plan)
    assert calls == [2] and len(output.draws) == 2
    return output


@pytest.mark.parametrize("arch", ["qwen3", "glm4_moe_lite", "nemotron_h"])
def test_a_decode_forward_makes_no_host_sync(
    arch: str, checkpoints: dict[str, Path], no_lazy_metadata: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dense attention, MLA with the fused MoE, and Mamba2 with the latent MoE."""
    _decode_after_prefill(_runner(checkpoints[arch]), monkeypatch)


def test_the_mtp_drafter_chains_its_drafts_with_one_read(
    checkpoints: dict[str, Path], no_lazy_metadata: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = _runner(checkpoints["nemotron_h"], mtp=True)
    assert runner.drafter is not None
    drafter, ops = runner.drafter, runner.drafter.ops
    reads: list[int] = []
    run, read = drafter.run, ops.read

    def guarded_run(*args, **kwargs):
        with no_host_sync(STAGING) as guard:

            def one_read(arrays):
                reads.append(len(arrays))
                with guard.allowing():
                    return read(arrays)

            monkeypatch.setattr(ops, "read", one_read)
            return run(*args, **kwargs)

    output = _decode_after_prefill(
        runner, monkeypatch, lambda: monkeypatch.setattr(drafter, "run", guarded_run), mtp=True, propose=3
    )
    assert reads == [3]  # the chain's three drafts, read together
    assert [len(p.token_ids) for p in output.proposals.values()] == [3, 3]
    assert output.mtp is not None and [rows for rows, _ in output.mtp.timed] == [2, 2, 2]  # cache pass, 2 chained

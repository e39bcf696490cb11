"""Projections an fp8 checkpoint keeps fp8 (the CUDA load, forced here on CPU): their scales shard as their
weights do, and the model run through kernels/fp8_matmul.py (under the interpreter) decodes the greedy ids of
the dequantizing load."""

from pathlib import Path

import pytest
import torch

from kernels.testing import kernel_test_device

DEVICE = kernel_test_device()  # turns the interpreter on before Triton is imported
pytest.importorskip("triton", reason="the kept fp8 weights run on a Triton kernel", exc_type=ImportError)

from deployments.model_rank.forward_batch import ParallelContext  # noqa: E402
from deployments.model_rank.models import load_model  # noqa: E402
from serve_app.fixtures.checkpoints import build_random_checkpoint  # noqa: E402
from serve_app.fixtures.fp8 import write_fp8_checkpoint  # noqa: E402
from tests.support.model_harness import PagedHarness  # noqa: E402

PROMPT = torch.randint(2, 512, (12,), generator=torch.Generator().manual_seed(5)).tolist()

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_checkpoint("qwen3", tmp_path_factory.mktemp("fp8_kept") / "src")


def _dequantized(param: torch.Tensor) -> torch.Tensor:
    scales = param.fp8_scales.repeat_interleave(param.fp8_block_k, 1)[:, : param.shape[1]]
    return param.float() * scales


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_kept_projections_decode_the_greedy_ids_of_the_dequantizing_load(
    source: Path, tmp_path: Path, dtype: str, tolerance: float
) -> None:
    checkpoint = write_fp8_checkpoint(source, tmp_path / "fp8", block=48)  # partial blocks at 64 and 128
    kept = load_model(checkpoint, dtype=dtype, device=DEVICE, pack=False, keep_fp8=True)
    dequantized = load_model(checkpoint, dtype=dtype, device=DEVICE, pack=False, keep_fp8=False)
    q_proj = kept.model.layers[0].self_attn.q_proj.weight
    assert q_proj.dtype == torch.float8_e4m3fn and q_proj.fp8_scales.shape == (128, 2)
    as_loaded = _dequantized(q_proj).to(getattr(torch, dtype))  # what the dequantizing load rounds it to
    assert torch.equal(as_loaded, dequantized.model.layers[0].self_attn.q_proj.weight)
    ours, reference = PagedHarness(kept), PagedHarness(dequantized)
    logits, expected = ours.prefill(0, PROMPT).float(), reference.prefill(0, PROMPT).float()
    assert (logits - expected).abs().max() <= tolerance * expected.abs().max()
    assert ours.generate(1, PROMPT, 4) == reference.generate(1, PROMPT, 4)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_tensor_parallel_rank_keeps_the_scales_of_its_own_shard(source: Path, tmp_path: Path, rank: int) -> None:
    checkpoint = write_fp8_checkpoint(source, tmp_path / "fp8", block=32)  # a rank's 64 columns: whole blocks
    parallel = ParallelContext(tp_rank=rank, tp_size=2)
    kept = load_model(checkpoint, dtype="float32", parallel=parallel, pack=False, keep_fp8=True)
    dequantized = dict(load_model(checkpoint, dtype="float32", parallel=parallel, pack=False).named_parameters())
    fp8 = {name: p for name, p in kept.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert {name.rsplit(".", 2)[-2] for name in fp8} == {"q_proj", "k_proj", "v_proj", "o_proj"} | {
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    for name, param in fp8.items():
        assert torch.equal(_dequantized(param), dequantized[name]), name

"""DeepSeek-sparse-attention families against transformers on tiny random checkpoints whose indexers keep 32
tokens per query (GLM-5.3: per token, a shared layer reusing the first's selection; GLM-5.3-Flash: 8-token
k-pools and their tail, KDA layers, hyper-connection streams, SwiGLU clamps): logits and greedy ids for
prompts of 1 to 300 tokens, bitwise batch invariance and verify rows, tensor parallelism on two ranks."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from deployments.model_rank.models import load_model
from serve_app.fixtures.archs import DSA_ARCHS
from serve_app.fixtures.checkpoints import build_random_checkpoint
from tests.support.model_harness import PagedHarness, tp_worker
from tests.support.reference import hf_model

transformers = pytest.importorskip("transformers")
NEW_TOKENS = 24


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dsa-parity")
    return {arch: build_random_checkpoint(arch, root / arch) for arch in DSA_ARCHS}


def _prompt(length: int, seed: int = 7) -> list[int]:
    return torch.randint(2, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_logits_and_greedy_match_transformers(arch: str, checkpoints: dict[str, Path]) -> None:
    reference = hf_model(checkpoints[arch])
    model = load_model(checkpoints[arch], dtype="float32")
    for length in (1, 9, 100, 300):
        prompt = _prompt(length, seed=length)
        ours = PagedHarness(model).step([(0, prompt)], all_logits=True)
        with torch.no_grad():
            theirs = reference(torch.tensor([prompt])).logits[0].float()
        assert (ours - theirs).abs().max().item() < 1e-4, length
    prompt = _prompt(100)
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    expected = out[0, len(prompt) :].tolist()
    assert PagedHarness(model).generate(0, prompt, NEW_TOKENS) == expected
    assert PagedHarness(model).generate(0, prompt, NEW_TOKENS, chunk=7) == expected


@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_the_indexer_selects(arch: str, checkpoints: dict[str, Path]) -> None:
    """Past 32 tokens the selection changes the logits: reading every key instead moves them far."""
    model = load_model(checkpoints[arch], dtype="float32")
    prompt = _prompt(100)
    sparse = PagedHarness(model).step([(0, prompt)], all_logits=True)
    for layer in model.model.layers:
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is not None:
            indexer.topk = indexer.pools_kept = 10_000
    dense = PagedHarness(model).step([(0, prompt)], all_logits=True)
    assert torch.equal(dense[:32], sparse[:32])  # within the first 32 tokens every key is kept
    assert (dense[40:] - sparse[40:]).abs().max().item() > 0.1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_last_token_logits_are_batch_invariant(arch: str, dtype: str, checkpoints: dict[str, Path]) -> None:
    """Whole prefill, chunks of 1/5/7 with cached decode, and inside a mixed batch: bitwise equal."""
    model = load_model(checkpoints[arch], dtype=dtype)
    prompt = _prompt(90)
    whole = PagedHarness(model).prefill(0, prompt)
    for chunk in (1, 5, 7):
        assert torch.equal(PagedHarness(model).prefill(0, prompt, chunk=chunk), whole), f"chunks of {chunk}"
    gen = torch.Generator().manual_seed(1)
    others = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (3, 29, 50)]
    harness = PagedHarness(model)
    harness.step([(1, others[0]), (2, others[1][:10])])
    harness.step([(1, [5]), (0, prompt[:40]), (2, others[1][10:]), (3, others[2])])
    batched = harness.step([(3, [7]), (2, [9]), (0, prompt[40:]), (1, [11])])
    assert torch.equal(batched[2], whole)


@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_verify_rows_equal_serial_decode_rows(arch: str, checkpoints: dict[str, Path]) -> None:
    model = load_model(checkpoints[arch], dtype="bfloat16")
    prompt, continuation = _prompt(70), [17, 301, 45, 9, 260]
    serial = PagedHarness(model)
    serial.prefill(0, prompt)
    rows = torch.stack([serial.step([(0, [token])])[0] for token in continuation])
    mixed = PagedHarness(model)
    mixed.step([(1, prompt[:9]), (0, prompt)])
    verified = mixed.step([(1, [3]), (0, continuation), (2, prompt[5:30])], all_logits=True)
    assert torch.equal(verified[1:6], rows)


def test_tensor_parallel_matches_single_rank(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """MLA and KDA heads, the experts and the shared expert split over two ranks, the indexers replicated:
    logits within 1e-5 of one rank's and equal greedy continuations, with prompts the indexers select in."""
    names, prompt = [str(checkpoints[arch]) for arch in DSA_ARCHS], _prompt(80)
    out = tmp_path / "tp.pt"
    mp.spawn(tp_worker, args=(2, str(tmp_path / "tp_init"), names, prompt, 16, str(out)), nprocs=2, join=True)
    results = torch.load(out)
    for name in names:
        model = load_model(name, dtype="float32")
        logits, continuation, _ = results[name]
        expected = PagedHarness(model).step([(0, prompt)], all_logits=True)
        assert (logits - expected).abs().max().item() < 1e-5, name
        assert continuation == PagedHarness(model).generate(0, prompt, 16), name


@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_bfloat16_indexers_weigh_heads_in_float32_from_the_checkpoint(arch: str, checkpoints: dict[str, Path]) -> None:
    """`weights_proj` stays a float32 tensor outside the packed bf16 projections (a packed layout read as a
    plain matrix would weigh the heads with garbage)."""
    from safetensors import safe_open

    model = load_model(checkpoints[arch], dtype="bfloat16")
    prefix = "model.language_model." if arch == "glm5_next" else "model."
    with safe_open(checkpoints[arch] / "model.safetensors", "pt") as stored:
        for index, layer in enumerate(model.model.layers):
            indexer = getattr(layer.self_attn, "indexer", None)
            if indexer is None:
                continue
            weight = indexer.weights_proj.weight
            expected = stored.get_tensor(f"{prefix}layers.{index}.self_attn.indexer.weights_proj.weight")
            assert weight.dtype == torch.float32 and torch.equal(weight, expected.float())

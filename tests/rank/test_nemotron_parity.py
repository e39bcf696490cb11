"""Nemotron-H beyond the shared parity and exactness tests (tests/rank/test_model_parity.py runs those over
HYBRID_ARCHS too): the block schedule, captured states restoring bit-identically, and the MTP step against
transformers' own blocks."""

from pathlib import Path
from typing import Any

import pytest
import torch

from deployments.model_rank.models import load_model
from serve_app.fixtures.checkpoints import build_random_checkpoint, nemotron_mtp_blocks
from tests.rank.test_model_parity import hf_model
from tests.support.model_harness import PagedHarness, Sequence

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = torch.randint(2, 512, (64,), generator=torch.Generator().manual_seed(7)).tolist()
CAPTURE_SLOT, SPARE_SLOT = 15, 14  # state slots no harness sequence takes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_checkpoint("nemotron_h", tmp_path_factory.mktemp("nemotron") / "ck")


def test_block_schedule_and_state_layout(checkpoint: Path) -> None:
    model = load_model(checkpoint, dtype="float32")
    assert [layer.kind for layer in model.model.layers] == ["mamba", "attention", "moe", "mamba", "mlp", "moe"]
    assert len(model.kv_cache_specs()) == 1 and len(model.state_specs()) == 2


def slot_states(harness: PagedHarness, slot: int) -> list[torch.Tensor]:
    return [pool[slot] for pools in harness.state_pools for pool in pools]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_states_restore_bit_identically(dtype: str, checkpoint: Path) -> None:
    """States captured after rows 20 and 31 of a batched prefill step equal a prefill that stops there, and a
    sequence restored from the row-31 capture (sharing the first two KV blocks) continues like the whole run."""
    model = load_model(checkpoint, dtype=dtype)
    expected = {}
    for row, slot in ((20, SPARE_SLOT), (31, CAPTURE_SLOT)):
        exact = PagedHarness(model)
        exact.prefill(0, PROMPT[: row + 1])
        expected[slot] = slot_states(exact, 0)
    harness = PagedHarness(model)  # binds the model's caches and pools: the harness in use comes last
    batch = harness.batch([(1, PROMPT[3:20]), (0, PROMPT[:48])])
    batch.state_captures = [[], [(20, SPARE_SLOT), (31, CAPTURE_SLOT)]]
    model(batch)
    for slot, states in expected.items():
        assert all(map(torch.equal, slot_states(harness, slot), states)), f"slot {slot}"
    harness.seqs[7] = Sequence(tokens=PROMPT[:32], blocks=harness.seqs[0].blocks[:2], slot=CAPTURE_SLOT)
    restored = harness.generate(7, PROMPT[32:], 8)
    assert restored == PagedHarness(model).generate(0, PROMPT, 8)


def reference_step(path: Path, config: Any) -> tuple[list[torch.nn.Module], dict[str, torch.Tensor]]:
    """transformers' blocks for the checkpoint's MTP step, loaded, and the step's fusion and end tensors."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    blocks, own = nemotron_mtp_blocks(config), {}
    for i, block in enumerate(blocks):
        state = {k.split(".", 3)[3]: v for k, v in tensors.items() if k.startswith(f"mtp.layers.{i}.")}
        for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"):
            if name in state:
                own[name] = state.pop(name)
        experts = sum(1 for k in state if k.startswith("mixer.experts.") and k.endswith(".up_proj.weight"))
        for proj in ("up_proj", "down_proj") if experts else ():
            stacked = [state.pop(f"mixer.experts.{e}.{proj}.weight") for e in range(experts)]
            state[f"mixer.experts.{proj}"] = torch.stack(stacked)  # transformers' in-memory layout
        block.load_state_dict(state)
    return blocks, own


def reference_mtp(path: Path, reference: torch.nn.Module, hidden: torch.Tensor, following: list[int]) -> torch.Tensor:
    """Logits of the checkpoint's MTP step run through transformers' own Nemotron-H blocks and norms."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNorm

    config = reference.config
    blocks, own = reference_step(path, config)
    norms = {}
    for name in ("enorm", "hnorm", "final_layernorm"):
        norms[name] = NemotronHRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        norms[name].weight.data.copy_(own[f"{name}.weight"])
    length = hidden.shape[1]
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]  # causal, additive
    with torch.no_grad():
        embeds = norms["enorm"](reference.model.embeddings(torch.tensor([following])))
        fused = torch.cat([embeds, norms["hnorm"](hidden)], dim=-1) @ own["eh_proj.weight"].T
        for block in blocks:
            fused = block(fused, attention_mask=mask)
        return reference.lm_head(norms["final_layernorm"](fused))[0].float()


def test_mtp_step_matches_transformers_blocks(checkpoint: Path) -> None:
    reference = hf_model(checkpoint)
    tokens, following = PROMPT[:-1], PROMPT[1:]
    with torch.no_grad():
        hidden = reference.model(torch.tensor([tokens])).last_hidden_state
    expected = reference_mtp(checkpoint, reference, hidden, following)
    model = load_model(checkpoint, dtype="float32")
    assert model.config.has_mtp and model.mtp is not None
    harness = PagedHarness(model)
    batch = harness.batch([(0, tokens)], all_logits=True)
    model.bind_mtp_kv_caches(harness.allocate(model.mtp_kv_cache_specs()))
    trunk = model(batch)  # advances the sequence's state slot: run once
    ours = model.mtp.compute_logits(model.mtp(trunk, torch.tensor(following), batch))
    assert (ours - expected).abs().max().item() < 1e-4
    drafts = model.mtp.greedy_drafts(model.mtp.residual(trunk, torch.tensor(following), batch))
    assert torch.equal(drafts, ours.argmax(-1))

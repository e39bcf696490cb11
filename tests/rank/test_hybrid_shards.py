"""Tensor-parallel shards of the hybrid families' recurrent layers: each rank's weights are its heads' slices
of the checkpoint, block by block, its state slots are its heads', and head counts that do not split are
refused naming the config key. (That the shards compute what one rank does: test_model_parity.py.)"""

from pathlib import Path

import pytest
import torch

from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.models import load_model
from serve_app.fixtures.checkpoints import build_random_checkpoint

pytest.importorskip("transformers")
SECOND_OF_TWO = ParallelContext(tp_rank=1, tp_size=2)


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shards")
    return {arch: build_random_checkpoint(arch, root / arch) for arch in ("qwen3_next", "qwen3_5_text", "nemotron_h")}


def second_halves(full: torch.Tensor, parts: list[int]) -> torch.Tensor:
    """Rank 1 of 2's share of blocks laid end to end along dim 0: each block's second half."""
    return torch.cat([block[block.shape[0] // 2 :] for block in full.split(parts)])


def first_mixers(checkpoint: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Layer 0's mixer on one rank and on rank 1 of 2."""
    return tuple(load_model(checkpoint, parallel=p).model.layers[0].mixer for p in (ParallelContext(), SECOND_OF_TWO))


def test_gated_delta_net_shards_by_key_heads(hybrids: dict[str, Path]) -> None:
    qkv = [2 * 16, 2 * 16, 4 * 16]  # q and k (2 key heads of 16), v (4 value heads of 16)
    for arch in ("qwen3_next", "qwen3_5_text"):
        whole, half = first_mixers(hybrids[arch])
        assert torch.equal(half.conv1d.weight, second_halves(whole.conv1d.weight, qkv)), arch
        for name in ("A_log", "dt_bias"):
            assert torch.equal(getattr(half, name), getattr(whole, name)[2:]), arch
        assert torch.equal(half.norm.weight, whole.norm.weight), arch  # per head, replicated
        assert torch.equal(half.out_proj.weight, whole.out_proj.weight[:, 32:]), arch
        specs = [
            (s.conv_shape, s.recurrent_shape) for s in load_model(hybrids[arch], parallel=SECOND_OF_TWO).state_specs()
        ]
        assert specs == [((3, sum(qkv) // 2), (2, 16, 16))] * 2, arch
        # Qwen3-Next's in_proj_qkvz / in_proj_ba are laid out key head by key head (rank 1: the second key
        # head's rows); Qwen3.5's in_proj_qkv is q | k | v, split block by block, and z / b / a by value heads.
        names = ["in_proj_qkvz", "in_proj_ba"] if arch == "qwen3_next" else ["in_proj_z", "in_proj_b", "in_proj_a"]
        for name in names:
            full = getattr(whole, name).weight
            assert torch.equal(getattr(half, name).weight, full[full.shape[0] // 2 :]), name
    assert torch.equal(half.in_proj_qkv.weight, second_halves(whole.in_proj_qkv.weight, qkv))


def test_mamba2_shards_by_heads_with_their_groups(hybrids: dict[str, Path]) -> None:
    whole, half = first_mixers(hybrids["nemotron_h"])
    inner, grouped, heads = 8 * 8, 2 * 16, 8  # 8 heads of 8; 2 groups of d_state 16
    assert torch.equal(
        half.in_proj.weight, second_halves(whole.in_proj.weight, [inner, inner, grouped, grouped, heads])
    )
    assert torch.equal(half.conv1d.weight, second_halves(whole.conv1d.weight, [inner, grouped, grouped]))
    assert torch.equal(half.conv1d.bias, second_halves(whole.conv1d.bias, [inner, grouped, grouped]))
    for name in ("dt_bias", "A_log", "D"):
        assert torch.equal(getattr(half, name), getattr(whole, name)[4:]), name
    assert torch.equal(half.norm.weight, whole.norm.weight[32:]) and half.norm.group_size == 32
    assert torch.equal(half.out_proj.weight, whole.out_proj.weight[:, 32:])
    model = load_model(hybrids["nemotron_h"], parallel=SECOND_OF_TWO)
    specs = [(s.conv_shape, s.recurrent_shape) for s in model.state_specs()]
    assert specs == [((3, (inner + 2 * grouped) // 2), (4, 8, 16))] * 2


def test_heads_that_do_not_split_are_refused(hybrids: dict[str, Path]) -> None:
    four = ParallelContext(tp_rank=0, tp_size=4)
    with pytest.raises(ValueError, match=r"linear_num_key_heads \(2\) does not divide evenly into 4"):
        load_model(hybrids["qwen3_next"], parallel=four)
    with pytest.raises(ValueError, match=r"n_groups \(2\) and mamba_num_heads \(8\) must both divide evenly into 4"):
        load_model(hybrids["nemotron_h"], parallel=four)

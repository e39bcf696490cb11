"""Qwen3.5's vision side on the rank, against transformers on a tiny random checkpoint: the tower's
embeddings per image, the multimodal positions of a prompt with images (transformers' rope index), and
the multimodal rotary, which must leave text rows exactly as plain RoPE leaves them."""

import importlib.util
import json
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch

from deployments.messages.step import SeqStep, StepImage
from deployments.model_rank.layers.rotary import RopeConfig, RotaryEmbedding, mrope_axes
from deployments.model_rank.models import load_model
from deployments.model_rank.models.qwen3_5_vision import VisionConfig
from deployments.model_rank.step_rows import image_positions
from deployments.tokenizer import CheckpointError
from tests.support.config_edits import with_config
from tests.support.images import ImagePrompts, picture, vision_checkpoint
from tests.support.reference import hf_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return vision_checkpoint(tmp_path_factory.mktemp("qwen3_5-vision"))


@pytest.fixture(scope="module")
def prompts(checkpoint) -> ImagePrompts:
    return ImagePrompts(checkpoint)


def _two_images(prompts: ImagePrompts):
    return prompts.build([[30, 31], picture(1, 40, 52), [40, 41, 42], picture(2, 16, 40), [50]])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tower_embeddings_equal_transformers(checkpoint, prompts, dtype: str) -> None:
    ids, images = _two_images(prompts)
    reference = hf_model(checkpoint).to(getattr(torch, dtype))
    patches = torch.from_numpy(np.concatenate([image.pixel_values for image in images]))
    grids = torch.tensor([list(image.grid_thw) for image in images])
    with torch.no_grad():
        expected = reference.model.visual(patches.to(reference.dtype), grid_thw=grids).pooler_output.float()
    model = load_model(checkpoint, dtype=dtype, vision=True)
    ours = torch.cat([model.encode_image(torch.from_numpy(i.pixel_values), i.grid_thw) for i in images]).float()
    assert ours.shape == (sum(image.length for image in images), 64)
    tolerance = 1e-5 if dtype == "float32" else 0.05 * float(expected.abs().max())
    torch.testing.assert_close(ours, expected, atol=tolerance, rtol=0)


def test_the_tower_loads_only_with_vision_on(checkpoint, tmp_path) -> None:
    assert load_model(checkpoint).config.vision is False
    on = load_model(checkpoint, vision=True).config
    assert on.vision and on.image_token_id == ImagePrompts(checkpoint).pad and on.spatial_merge_size == 2
    from serve_app.fixtures.checkpoints import build_random_checkpoint

    build_random_checkpoint("qwen3", tmp_path, seed=1)
    with pytest.raises(CheckpointError, match="no vision tower"):
        load_model(tmp_path, vision=True)


def test_vision_config_keys_left_out_take_transformers_defaults(checkpoint, prompts, tmp_path) -> None:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig

    theirs = Qwen3_5VisionConfig()
    assert all(
        getattr(VisionConfig(), key.name) == getattr(theirs, key.name)
        for key in fields(VisionConfig)
        if key.name != "rope_theta"
    )
    vision = json.loads((checkpoint / "config.json").read_text())["vision_config"]
    left_out = [key for key, value in vision.items() if key != "model_type" and getattr(theirs, key, None) == value]
    assert "num_position_embeddings" in left_out and "spatial_merge_size" in left_out
    out = with_config(checkpoint, tmp_path / "defaults", lambda c: [c["vision_config"].pop(k) for k in left_out])
    _, images = _two_images(prompts)
    full, defaults = load_model(checkpoint, vision=True), load_model(out, vision=True)
    for image in images:
        patches = torch.from_numpy(image.pixel_values)
        assert torch.equal(defaults.encode_image(patches, image.grid_thw), full.encode_image(patches, image.grid_thw))


def test_a_placeholder_id_outside_the_vocabulary_is_refused_with_vision_on(checkpoint, tmp_path) -> None:
    out = with_config(
        checkpoint, tmp_path / "outside", lambda c: c.update(image_token_id=c["text_config"]["vocab_size"])
    )
    assert load_model(out).config.vision is False  # text only: the id is never used
    with pytest.raises(CheckpointError, match=r"config\.json: image_token_id \(512\) is outside the vocabulary"):
        load_model(out, vision=True)


def test_multimodal_positions_equal_transformers_rope_index(checkpoint, prompts) -> None:
    ids, images = _two_images(prompts)
    reference = hf_model(checkpoint)
    input_ids = torch.tensor([ids])
    expected, delta = reference.model.get_rope_index(
        input_ids,
        mm_token_type_ids=(input_ids == prompts.pad).int(),
        image_grid_thw=torch.tensor([list(image.grid_thw) for image in images]),
    )
    placed = [
        StepImage(f"r/{i}", image.offset, (1, image.grid_thw[1] // 2, image.grid_thw[2] // 2), image.grid_thw)
        for i, image in enumerate(images)
    ]
    whole = image_positions(SeqStep(ids, 0, [], images=placed))
    assert whole == expected[:, 0].tolist()
    # A chunk starting mid-image and a decode row after both images (the shift of the images before it).
    middle = image_positions(SeqStep(ids[10:25], 10, [], images=placed[:1]))
    assert middle == expected[:, 0, 10:25].tolist()
    shift = sum(image.position_shift for image in placed)
    assert image_positions(SeqStep([7], len(ids), [], rope_delta=shift, images=[]))[0] == [len(ids) + int(delta)]


def test_multimodal_rotary_leaves_text_rows_as_plain_rope() -> None:
    rope = RopeConfig(partial_rotary_factor=0.25, mrope_section=(11, 11, 10))
    rotary = RotaryEmbedding(256, rope, 4096)
    # Interleaved over the rotary pairs whatever the sections sum to, as transformers' Qwen3.5 rotary.
    assert mrope_axes((2, 1, 1), 4).tolist() == mrope_axes((11, 11, 10), 4).tolist() == [0, 1, 2, 0]
    assert mrope_axes((0, 4, 0), 4).tolist() == [0, 1, 0, 0]
    generator = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(9, 4, 256, generator=generator).to(dtype)
        k = torch.randn(9, 2, 256, generator=generator).to(dtype)
        positions = torch.arange(100, 109)
        plain = rotary(positions, q, k)
        same = rotary(positions, q, k, positions.expand(3, -1).contiguous())
        assert all(torch.equal(a, b) for a, b in zip(plain, same))
    # Row positions apart from the temporal ones turn exactly the row axis's pairs (both halves of each).
    image = positions.expand(3, -1).clone()
    image[1] += 500
    q, k = (t.float() for t in (q, k))
    moved, plain = rotary(positions, q, k, image), rotary(positions, q, k)
    row_pairs = rotary.mrope_axes == 1
    expected = torch.cat([row_pairs, row_pairs, torch.zeros(256 - 64, dtype=torch.bool)])
    assert (moved[0] != plain[0]).any(dim=0).any(dim=0).tolist() == expected.tolist()


@pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx is not installed")
def test_the_mlx_tower_equals_the_torch_tower(checkpoint, prompts) -> None:
    from deployments.model_rank.mlx_rank.arrays import from_torch, to_torch
    from deployments.model_rank.mlx_rank.vision import MlxVisionTower

    _, images = _two_images(prompts)
    model = load_model(checkpoint, vision=True)
    tower = MlxVisionTower(model.visual)
    for image in images:
        patches = torch.from_numpy(image.pixel_values)
        ours = to_torch(tower(from_torch(patches), image.grid_thw))
        torch.testing.assert_close(ours, model.encode_image(patches, image.grid_thw), atol=1e-5, rtol=0)

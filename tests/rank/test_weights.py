"""Checkpoint loading: shards, expert layouts, dtype choices, legacy config keys, MTP, Nemotron-H's layouts,
malformed files."""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.layers.rotary import RopeConfig
from deployments.model_rank.models import load_model
from deployments.tokenizer import CheckpointError
from serve_app.fixtures.checkpoints import build_random_checkpoint
from tests.support.model_harness import PagedHarness

pytest.importorskip("transformers")
PROMPT = list(range(2, 40))


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/rank/conftest.py


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_checkpoint("glm4_moe", tmp_path_factory.mktemp("glm") / "ck")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3") / "ck")


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def edit_config(path: Path, edit: Callable[[dict], None], name: str = "config.json") -> None:
    config = json.loads((path / name).read_text())
    edit(config)
    (path / name).write_text(json.dumps(config))


def shard(src: Path, dst: Path, parts: int = 3) -> Path:
    """The same checkpoint as `parts` safetensors shards plus model.safetensors.index.json."""
    dst.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i in range(parts):
        file = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        group = names[i::parts]
        save_file({n: tensors[n] for n in group}, str(dst / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in group})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def last_logits(model: torch.nn.Module) -> torch.Tensor:
    return PagedHarness(model).prefill(0, PROMPT)


def test_sharded_checkpoint_loads_like_single_file(glm: Path, tmp_path: Path) -> None:
    single, sharded = load_model(glm), load_model(shard(glm, tmp_path / "sharded"))
    assert_same_weights(single, sharded)
    assert torch.equal(last_logits(single), last_logits(sharded))


def test_fused_expert_layout_loads_like_per_expert(glm: Path, tmp_path: Path) -> None:
    def fuse(tensors: dict[str, torch.Tensor]) -> None:
        for layer in (1, 2, 3):
            prefix = f"model.layers.{layer}.mlp.experts"
            per = {
                proj: torch.stack([tensors.pop(f"{prefix}.{e}.{proj}.weight") for e in range(8)])
                for proj in ("gate_proj", "up_proj", "down_proj")
            }
            tensors[f"{prefix}.gate_up_proj"] = torch.cat([per["gate_proj"], per["up_proj"]], dim=1)  # [E, 2I, H]
            tensors[f"{prefix}.down_proj"] = per["down_proj"]  # [E, H, I]

    fused = copy(glm, tmp_path / "fused")
    edit_tensors(fused, fuse)
    assert_same_weights(load_model(glm), load_model(fused))


def test_dtype_choices(glm: Path, tmp_path: Path) -> None:
    assert load_model(glm).config.dtype == torch.float32  # config.json says float32
    for choice, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32)):
        model = load_model(glm, dtype=choice)
        assert model.config.dtype == dtype
        for name, param in model.named_parameters():
            assert param.dtype == (torch.float32 if name.endswith("e_score_correction_bias") else dtype), name
    with pytest.raises(ValueError, match="int8"):
        load_model(glm, dtype="int8")
    bf16 = build_random_checkpoint("qwen3", tmp_path / "bf16", dtype="bfloat16")
    assert load_model(bf16).config.dtype == torch.bfloat16
    edit_config(bf16, lambda c: c.pop("dtype"))
    assert load_model(bf16).config.dtype == torch.bfloat16  # from the tensors themselves
    edit_config(bf16, lambda c: c.update(torch_dtype="float16"))
    assert load_model(bf16).config.dtype == torch.float16  # legacy key


def test_legacy_config_keys_load_the_same_model(glm: Path, tmp_path: Path) -> None:
    def legacy(config: dict) -> None:
        rope = config.pop("rope_parameters")
        config.update(rope_theta=rope["rope_theta"], torch_dtype=config.pop("dtype"))
        config["num_local_experts"] = config.pop("n_routed_experts")
        # GLM's partial_rotary_factor defaults to 0.5 when absent, as in hub configs that omit it.

    old = copy(glm, tmp_path / "legacy")
    edit_config(old, legacy)
    assert torch.equal(last_logits(load_model(glm)), last_logits(load_model(old)))


def test_rope_config_reads_both_key_styles() -> None:
    legacy = RopeConfig.from_hf(
        {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}, "partial_rotary_factor": 0.25}
    )
    modern = RopeConfig.from_hf(
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5, "partial_rotary_factor": 0.25}}
    )
    assert legacy == modern and legacy.theta == 5e5 and legacy.partial_rotary_factor == 0.25
    assert RopeConfig.from_hf({"rope_theta": 1e4}, default_partial=0.5).partial_rotary_factor == 0.5
    llama3 = RopeConfig.from_hf(
        {"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}}
    )
    assert llama3.original_max_position_embeddings == 4096
    with pytest.raises(ValueError, match="longrope"):
        RopeConfig.from_hf({"rope_scaling": {"rope_type": "longrope"}})


def test_mtp_layer_loading(glm: Path, tmp_path: Path) -> None:
    model = load_model(glm)
    assert model.config.has_mtp and model.mtp is not None
    assert model.mtp_kv_cache_specs() == model.kv_cache_specs()[:1]
    assert model.mtp.embed_tokens is model.model.embed_tokens  # equal copies in the checkpoint are shared
    assert model.mtp.shared_head.head is model.lm_head

    no_copies = copy(glm, tmp_path / "no-copies")
    copies = ("model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight")
    edit_tensors(no_copies, lambda t: [t.pop(n) for n in copies])
    assert load_model(no_copies).mtp is not None

    without = copy(glm, tmp_path / "without")
    edit_tensors(without, lambda t: [t.pop(n) for n in list(t) if n.startswith("model.layers.3.")])
    plain = load_model(without)
    assert not plain.config.has_mtp and plain.mtp is None and plain.mtp_kv_cache_specs() == []

    undeclared = copy(glm, tmp_path / "undeclared")
    edit_config(undeclared, lambda c: c.update(num_nextn_predict_layers=0))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*unexpected.*model\.layers\.3"):
        load_model(undeclared)


def test_cache_specs_info_and_tensor_parallel_shapes(glm: Path, qwen3: Path, tmp_path: Path) -> None:
    model = load_model(qwen3)
    assert [s.kind for s in model.kv_cache_specs()] == ["kv", "kv"]
    assert (model.kv_cache_specs()[0].num_kv_heads, model.kv_cache_specs()[0].head_dim) == (2, 32)
    info = model.config
    assert (info.model_type, info.vocab_size, info.hidden_size, info.num_hidden_layers) == ("qwen3", 512, 64, 2)
    assert info.eos_token_ids == [1] and info.max_position_embeddings == 1024
    assert model.weight_bytes() == sum(p.numel() * 4 for p in model.parameters())
    assert load_model(qwen3, dtype="bfloat16").weight_bytes() * 2 == model.weight_bytes()
    half = load_model(qwen3, parallel=ParallelContext(tp_rank=1, tp_size=2))
    assert half.kv_cache_specs()[0].num_kv_heads == 1
    assert half.model.layers[0].mlp.gate_proj.weight.shape == (64, 64)
    # 4 ranks over 2 kv heads: ranks 2 and 3 both hold kv head 1 (rows 32:64 of k_proj).
    quarter = load_model(qwen3, parallel=ParallelContext(tp_rank=3, tp_size=4))
    full_k = model.model.layers[0].self_attn.k_proj.weight
    assert torch.equal(quarter.model.layers[0].self_attn.k_proj.weight, full_k[32:64])
    assert quarter.model.layers[0].self_attn.q_proj.weight.shape == (32, 64)
    lite = load_model(build_random_checkpoint("glm4_moe_lite", tmp_path / "lite"))
    assert {s.kind for s in lite.kv_cache_specs()} == {"latent"} and lite.kv_cache_specs()[0].latent_dim == 32 + 8


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_checkpoint("nemotron_h", tmp_path_factory.mktemp("nemotron") / "ck")


def test_nemotron_hub_config_and_transformers_names_load_the_same_model(nemotron: Path, tmp_path: Path) -> None:
    """The hub's spellings (pattern strings, num_hidden_layers, mamba_* keys, Infinity) and the names
    transformers uses in memory (model.*, stacked experts) load what the fixture's save loads."""
    kinds = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}

    def hub(config: dict) -> None:
        pattern = "".join(kinds[kind] for kind in config.pop("layers_block_type"))
        mtp = "".join(kinds[kind] for kind in config.pop("mtp_layers_block_type"))
        config.update(hybrid_override_pattern=pattern, mtp_hybrid_override_pattern=mtp, num_hidden_layers=6)
        config.update(time_step_limit=[0.0, float("inf")])  # json writes Infinity
        for key, legacy in (("n_groups", "mamba_n_groups"), ("conv_kernel", "mamba_d_conv")):
            config[legacy] = config.pop(key)

    def in_memory(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if n.startswith("backbone.")]:
            tensors["model." + name.removeprefix("backbone.")] = tensors.pop(name)
        for layer in (2, 5):
            prefix = f"model.layers.{layer}.mixer.experts"
            for proj in ("up_proj", "down_proj"):
                stacked = [tensors.pop(f"{prefix}.{e}.{proj}.weight") for e in range(8)]
                tensors[f"{prefix}.{proj}"] = torch.stack(stacked)  # up [E, I, latent], down [E, latent, I]

    other = copy(nemotron, tmp_path / "other")
    edit_config(other, hub)
    edit_tensors(other, in_memory)
    model = load_model(nemotron)
    assert_same_weights(model, load_model(other))
    assert torch.equal(last_logits(model), last_logits(load_model(other)))


def test_nemotron_specs_mtp_loading_and_refusals(nemotron: Path, tmp_path: Path) -> None:
    model = load_model(nemotron)
    assert [len(s.recurrent_shape) for s in model.state_specs()] == [3, 3]  # two Mamba2 blocks
    assert model.state_specs()[0].conv_shape == (3, 8 * 8 + 2 * 2 * 16)  # kernel - 1, x + B + C
    assert model.config.has_mtp and model.mtp is not None
    assert model.mtp_kv_cache_specs() == model.kv_cache_specs()  # one attention block each, alike
    assert model.mtp.embed_tokens is model.model.embed_tokens and model.mtp.lm_head is model.lm_head

    undeclared = copy(nemotron, tmp_path / "undeclared")  # MTP tensors beside num_nextn_predict_layers=0
    edit_config(undeclared, lambda c: c.update(num_nextn_predict_layers=0))
    plain = load_model(undeclared)  # ignored, as transformers ignores `mtp.*`
    assert not plain.config.has_mtp and plain.mtp is None and plain.mtp_kv_cache_specs() == []

    two_steps = copy(nemotron, tmp_path / "two-steps")  # a second step (layers 2, 3): only the first drafts
    edit_config(two_steps, lambda c: c.update(num_nextn_predict_layers=2))
    edit_tensors(two_steps, _second_mtp_step)
    assert_same_weights(model, load_model(two_steps))

    recurrent = build_random_checkpoint("nemotron_h", tmp_path / "recurrent", mtp_layers_block_type=["mamba", "moe"])
    loaded = load_model(recurrent)  # loaded, but a step with state slots of its own does not draft
    assert loaded.mtp is not None and not loaded.config.has_mtp and loaded.mtp_kv_cache_specs() == []
    with pytest.raises(ValueError, match="no MTP layer that drafts"):
        loaded.bind_mtp_kv_caches([])
    for edit, pattern in (
        (lambda c: c.update(layers_block_type=["conv", *c["layers_block_type"][1:]]), "unknown or no block types"),
        (lambda c: c.update(mlp_hidden_act="gelu"), "mlp_hidden_act 'gelu'"),
    ):
        bad = copy(nemotron, tmp_path / "bad")
        edit_config(bad, edit)
        with pytest.raises(CheckpointError, match=pattern):
            load_model(bad)
        shutil.rmtree(bad)


def _second_mtp_step(tensors: dict[str, torch.Tensor]) -> None:
    """MTP layers 0 and 1 again, doubled, as layers 2 and 3: a second MTP step (which must not load)."""
    for name in [n for n in tensors if n.startswith(("mtp.layers.0.", "mtp.layers.1."))]:
        layer = int(name.split(".")[2])
        tensors[name.replace(f"mtp.layers.{layer}.", f"mtp.layers.{layer + 2}.", 1)] = tensors[name] * 2


def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.pop(name)


def _set(name: str, tensor: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.update({name: tensor})


EXPERT_UP = "model.layers.1.mlp.experts.{}.up_proj.weight"
TENSOR_CASES = {
    "missing tensor": (_drop("model.norm.weight"), r"model\.safetensors: missing tensors.*model\.norm\.weight"),
    "missing expert": (_drop(EXPERT_UP.format(3)), r"model\.safetensors: missing.*experts \[3\]"),
    "extra tensor": (_set("model.layers.0.self_attn.extra.weight", torch.ones(2)), r"model\.safetensors: unexpected"),
    "mis-shaped": (_set("model.norm.weight", torch.ones(65)), r"model\.safetensors: tensor 'model\.norm\.weight'.*65"),
    "expert beyond count": (_set(EXPERT_UP.format(9), torch.ones(32, 64)), r"model\.safetensors.*expert 9"),
}


@pytest.mark.parametrize("case", TENSOR_CASES)
def test_malformed_tensors_name_the_file(case: str, glm: Path, tmp_path: Path) -> None:
    edit, pattern = TENSOR_CASES[case]
    bad = copy(glm, tmp_path / "bad")
    edit_tensors(bad, edit)
    with pytest.raises(CheckpointError, match=pattern):
        load_model(bad)


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda p: (p / name).write_text(text)


def _index_pointing_at(file: str | None) -> Callable[[Path], None]:
    """Move model.norm.weight's index entry to `file` (None: another existing shard)."""

    def edit(path: Path) -> None:
        index = json.loads((path / "model.safetensors.index.json").read_text())
        current = index["weight_map"]["model.norm.weight"]
        other = next(f for f in index["weight_map"].values() if f != current)
        index["weight_map"]["model.norm.weight"] = file or other
        (path / "model.safetensors.index.json").write_text(json.dumps(index))

    return edit


def _config(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda p: edit_config(p, edit)


def _unlink(name: str) -> Callable[[Path], None]:
    return lambda p: (p / name).unlink()


INDEX = "model.safetensors.index.json"
FILE_CASES = {
    "no config": (_unlink("config.json"), r"config\.json: missing"),
    "config not json": (_write("config.json", "{oops"), r"config\.json: not readable JSON"),
    "unsupported model_type": (_config(lambda c: c.update(model_type="mamba")), r"config\.json: model_type 'mamba'"),
    "config key missing": (_config(lambda c: c.pop("hidden_size")), r"config\.json: config key 'hidden_size'"),
    "no weights": (_unlink("model.safetensors"), r"no model\.safetensors or model\.safetensors\.index\.json"),
    "corrupt safetensors": (_write("model.safetensors", "garbage"), r"model\.safetensors: unreadable"),
    "index not json": (_write(INDEX, "[1,"), r"model\.safetensors\.index\.json: not readable"),
    "index without map": (_write(INDEX, "{}"), r"model\.safetensors\.index\.json: needs"),
    "index names missing shard": (_index_pointing_at("model-00009-of-00009.safetensors"), r"index\.json: shard mod"),
    "shard lacks tensor": (_index_pointing_at(None), r"-of-00003\.safetensors: lacks tensor 'model\.norm\.weight'"),
}


@pytest.mark.parametrize("case", FILE_CASES)
def test_malformed_files_name_the_file(case: str, glm: Path, tmp_path: Path) -> None:
    edit, pattern = FILE_CASES[case]
    bad = shard(glm, tmp_path / "bad") if "index" in case or "shard" in case else copy(glm, tmp_path / "bad")
    edit(bad)
    with pytest.raises(CheckpointError, match=pattern):
        load_model(bad)


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrids")
    return {arch: build_random_checkpoint(arch, root / arch) for arch in ("qwen3_next", "qwen3_5")}


def test_multimodal_checkpoint_serves_its_language_model(hybrids: dict[str, Path], tmp_path: Path) -> None:
    """qwen3_5 reads `text_config` and `model.language_model.*` and leaves the vision tower unread: the same
    model as the language model saved on its own (qwen3_5_text, `model.*`)."""
    qwen3_5 = hybrids["qwen3_5"]
    vision = [n for n in load_file(str(qwen3_5 / "model.safetensors")) if n.startswith("model.visual.")]
    assert vision  # the fixture saves the tower
    model = load_model(qwen3_5)
    assert model.config.model_type == "qwen3_5" and not any("visual" in n for n, _ in model.named_parameters())

    def text_only(tensors: dict[str, torch.Tensor]) -> None:
        for name in list(tensors):
            tensor = tensors.pop(name)
            if not name.startswith("model.visual."):
                tensors[name.replace("model.language_model.", "model.")] = tensor

    def text_config_only(config: dict) -> None:
        config.update(config.pop("text_config"))  # its model_type: qwen3_5_text
        config.pop("vision_config")

    alone = copy(qwen3_5, tmp_path / "text")
    edit_tensors(alone, text_only)
    edit_config(alone, text_config_only)
    text_model = load_model(alone)
    assert text_model.config.model_type == "qwen3_5_text"
    assert_same_weights(model, text_model)
    assert torch.equal(last_logits(model), last_logits(text_model))

    named = copy(qwen3_5, tmp_path / "named")  # a text config over the multimodal names, as transformers loads
    edit_config(named, text_config_only)
    assert_same_weights(model, load_model(named))


def test_multimodal_tie_word_embeddings_is_the_outer_configs(hybrids: dict[str, Path], tmp_path: Path) -> None:
    tied = copy(hybrids["qwen3_5"], tmp_path / "tied")
    edit_config(tied, lambda c: c.update(tie_word_embeddings=True))
    edit_tensors(tied, _drop("lm_head.weight"))
    model = load_model(tied)
    assert model.lm_head.tied and model.lm_head.weight is model.model.embed_tokens.weight


def test_hybrid_layer_types_state_specs_and_ignored_tensors(hybrids: dict[str, Path], tmp_path: Path) -> None:
    qwen3_next = hybrids["qwen3_next"]
    model = load_model(qwen3_next)
    assert [type(layer.mixer).__name__ for layer in model.model.layers] == [
        "GroupedProjectionDeltaNet",
        "GatedSelfAttention",
        "GroupedProjectionDeltaNet",
    ]
    assert [(s.num_kv_heads, s.head_dim) for s in model.kv_cache_specs()] == [(2, 32)]  # attention layers only
    conv_channels = 2 * 2 * 16 + 4 * 16  # q and k (2 key heads of 16), v (4 value heads of 16)
    assert [(s.conv_shape, s.recurrent_shape) for s in model.state_specs()] == [((3, conv_channels), (4, 16, 16))] * 2

    def interval_of_two(config: dict) -> None:  # older configs: full attention every N layers
        config.pop("layer_types")
        config["full_attention_interval"] = 2

    interval = copy(qwen3_next, tmp_path / "interval")
    edit_config(interval, interval_of_two)
    assert torch.equal(last_logits(model), last_logits(load_model(interval)))
    with_mtp = copy(qwen3_next, tmp_path / "mtp")  # hub checkpoints carry their MTP layer: not loaded
    edit_tensors(with_mtp, _set("mtp.fc.weight", torch.ones(64, 128)))
    assert_same_weights(model, load_model(with_mtp))

    bad = copy(qwen3_next, tmp_path / "bad-types")
    edit_config(bad, lambda c: c.update(layer_types=["linear_attention", "sliding_attention", "full_attention"]))
    with pytest.raises(CheckpointError, match=r"config\.json: layer_types \['sliding_attention'\]"):
        load_model(bad)

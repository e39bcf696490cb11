"""Block-scaled FP8 checkpoints: dequantized at load to what transformers computes on the dequantized
weights, scales met across shards, the dtype `auto` picks, and every refusal naming its key or tensor."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deployments.model_rank.models import check_checkpoint, load_model
from deployments.tokenizer import CheckpointError
from serve_app.cli import main as cli_main
from serve_app.fixtures.checkpoints import build_random_checkpoint
from serve_app.fixtures.fp8 import quantize_blocks
from tests.support.model_harness import PagedHarness
from tests.support.reference import hf_greedy

BLOCK = 48  # the tiny models' 32, 64 and 128 features end in partial blocks
PROMPT = torch.randint(2, 512, (24,), generator=torch.Generator().manual_seed(3)).tolist()
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fp8")
    src = build_random_checkpoint("qwen3", root / "src")
    assert cli_main(["fixture", "fp8", str(src), str(root / "fp8"), "--block", str(BLOCK)]) == 0
    return root / "fp8"


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            out.update((name, handle.get_tensor(name)) for name in handle.keys())
    return out


def _dequantized_float64(weight: torch.Tensor, scale_inv: torch.Tensor, block: int) -> torch.Tensor:
    """Block by block in float64 (exact: 4 mantissa bits times 24), rounded once to float32."""
    out = torch.empty(weight.shape, dtype=torch.float64)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = weight[rows, cols].double() * scale_inv[i, j].double()
    return out.float()


def _copy(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor], dict], None]) -> Path:
    """`src` with its tensors and config edited in place by `edit`, written to `dst`."""
    dst.mkdir()
    tensors, config = _tensors(src), json.loads((src / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_greedy_ids_equal_transformers_on_the_float64_dequantized_copy(fp8_dir: Path, tmp_path: Path) -> None:
    def dequantize_all(tensors: dict[str, torch.Tensor], config: dict) -> None:
        for name in [n for n in tensors if n.endswith("_scale_inv")]:
            weight = name.removesuffix("_scale_inv")
            tensors[weight] = _dequantized_float64(tensors[weight], tensors.pop(name), BLOCK)
        del config["quantization_config"]

    reference = _copy(fp8_dir, tmp_path / "dequantized", dequantize_all)
    model = load_model(fp8_dir, dtype="float32")
    assert model.weights_format == f"fp8 e4m3 ({BLOCK}x{BLOCK} blocks) dequantized to float32"
    assert PagedHarness(model).generate(0, PROMPT, 8) == hf_greedy(reference, PROMPT, 8)
    ours = dict(model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(ours, _tensors(reference)[Q_PROJ])


def test_a_weight_meets_its_scale_in_another_shard(fp8_dir: Path, tmp_path: Path) -> None:
    tensors = _tensors(fp8_dir)
    (tmp_path / "config.json").write_text((fp8_dir / "config.json").read_text())
    # Scales in the first file the stream reads, two weights in the second: the order cannot pair them.
    first = {n: t for n, t in tensors.items() if n.endswith("_scale_inv") or "layers" not in n}
    second = {n: t for n, t in tensors.items() if n not in first}
    second[Q_PROJ + "_scale_inv"] = first.pop(Q_PROJ + "_scale_inv")
    weight_map = {}
    for file, part in (("a.safetensors", first), ("b.safetensors", second)):
        save_file(part, str(tmp_path / file))
        weight_map.update(dict.fromkeys(part, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded, whole = load_model(tmp_path, dtype="float32"), load_model(fp8_dir, dtype="float32")
    for (name, a), b in zip(sharded.named_parameters(), whole.parameters()):
        assert torch.equal(a, b), name


def test_auto_dtype_is_bfloat16_unless_the_config_names_one(fp8_dir: Path, tmp_path: Path) -> None:
    assert load_model(fp8_dir).config.dtype == torch.float32  # the fixture's config declares float32

    def undeclared(tensors: dict[str, torch.Tensor], config: dict) -> None:
        config.pop("dtype", None)
        config.pop("torch_dtype", None)

    model = load_model(_copy(fp8_dir, tmp_path / "undeclared", undeclared))
    assert model.config.dtype == torch.bfloat16
    assert dict(model.named_parameters())[Q_PROJ].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("quant_method", "gptq"),
        ("fmt", "e5m2"),
        ("activation_scheme", "static"),
        ("weight_block_size", [128]),
        ("modules_to_not_convert", "lm_head"),
        ("scale_fmt", "ue8m0"),
    ],
)
def test_other_quantization_configs_are_refused_naming_key_and_value(
    fp8_dir: Path, tmp_path: Path, key: str, value: object
) -> None:
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"][key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(fp8_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"quantization_config.{key} = {value!r}".replace("[", r"\[")):
        check_checkpoint(tmp_path)


def _drop_scale(tensors: dict[str, torch.Tensor], config: dict) -> None:
    del tensors[Q_PROJ + "_scale_inv"]


def _wrong_grid(tensors: dict[str, torch.Tensor], config: dict) -> None:
    tensors[Q_PROJ + "_scale_inv"] = tensors[Q_PROJ + "_scale_inv"][:1]


def _fp8_embedding(tensors: dict[str, torch.Tensor], config: dict) -> None:
    name = "model.embed_tokens.weight"
    tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(tensors[name], BLOCK)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_drop_scale, f"fp8 tensor '{Q_PROJ}' has no '{Q_PROJ}_scale_inv'"),
        (_wrong_grid, rf"'{Q_PROJ}_scale_inv' has shape \(1, 2\); the blocks of '{Q_PROJ}' \(128, 64\) need \(3, 2\)"),
        (_fp8_embedding, "tensor 'model.embed_tokens.weight' is fp8 but not a projection"),
    ],
)
def test_malformed_fp8_tensors_are_refused_naming_the_tensor(
    fp8_dir: Path, tmp_path: Path, edit: Callable, message: str
) -> None:
    with pytest.raises(CheckpointError, match=message):
        load_model(_copy(fp8_dir, tmp_path / "bad", edit), dtype="float32")


def test_fixture_scales_are_block_amax_over_448_and_keeps_the_rest(fp8_dir: Path) -> None:
    source, written = _tensors(fp8_dir.parent / "src"), _tensors(fp8_dir)
    weight, scale = written[Q_PROJ], written[Q_PROJ + "_scale_inv"]
    assert weight.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    assert scale[1, 0] == source[Q_PROJ][48:96, :48].abs().max() / 448
    error = (_dequantized_float64(weight, scale, BLOCK) - source[Q_PROJ]).abs()
    assert error.max() <= source[Q_PROJ].abs().max() / 16  # e4m3: 3 mantissa bits
    kept = [n for n in source if "norm" in n or "embed" in n]
    assert kept and all(torch.equal(written[n], source[n]) for n in kept)
    assert json.loads((fp8_dir / "config.json").read_text())["quantization_config"]["weight_block_size"] == [48, 48]

"""GGUF files as checkpoints (docs/gguf.md), against transformers' own `gguf_file=` loading: the derived
config and tokenizer, the dequantized weights bit for bit, greedy ids in float32; split sets; kept blocks."""

from pathlib import Path

import pytest
import torch

from deployments.gguf_files.folder import checkpoint_folder
from deployments.model_rank.models import load_model
from kernels import quant_gemm
from serve_app.fixtures.checkpoints import build_random_checkpoint
from serve_app.fixtures.gguf_writer import write_gguf
from serve_app.fixtures.tokenizer_builder import build_tokenizer
from tests.support.model_harness import PagedHarness

transformers = pytest.importorskip("transformers")
# Sizes whose rows are whole 256-element blocks, so Q4_K_M files hold K-quant types, not their fallbacks.
K_QUANT_SHAPE = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
FILES = [("llama", "Q8_0"), ("qwen3", "Q4_K_M"), ("qwen3_moe", "Q4_0")]


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENSORFOLD_GGUF_CACHE", str(tmp_path_factory.getbasetemp() / "gguf-cache"))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch, file_type in FILES:
        shape = K_QUANT_SHAPE if arch == "qwen3" else {"mlp_only_layers": []} if arch == "qwen3_moe" else {}
        checkpoint = build_random_checkpoint(arch, root / arch, seed=5, **shape)
        build_tokenizer(checkpoint, family="qwen")
        out[arch] = write_gguf(checkpoint, root / f"{arch}-{file_type}.gguf", file_type)[0]
    return out


def hf_gguf_model(path: Path, folder: Path) -> torch.nn.Module:
    """transformers' model of the file, dequantized to float32 by its own GGUF loader. The config is ours:
    transformers' GGUF tables drop `attention.key_length`, which these tiny models need as head_dim."""
    transformers.utils.logging.set_verbosity_error()
    config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def fused_experts(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our expert stacks under transformers' names: gate and up as one `gate_up_proj` [E, 2I, H]."""
    out = dict(params)
    for name in [n for n in params if n.endswith(".experts.gate_proj")]:
        prefix = name.removesuffix("gate_proj")
        out[prefix + "gate_up_proj"] = torch.cat([out.pop(name), out.pop(prefix + "up_proj")], dim=1)
    return out


@pytest.mark.parametrize(("arch", "file_type"), FILES)
def test_the_dequantized_path_equals_transformers_gguf_loading(arch: str, file_type: str, files: dict) -> None:
    path = files[arch]
    folder = checkpoint_folder(path)
    model = load_model(folder, dtype="float32")
    reference = hf_gguf_model(path, folder)
    ours = fused_experts(dict(model.named_parameters()))
    theirs = {name: t for name, t in reference.state_dict().items() if name in ours}
    assert len(theirs) >= len(ours) - 1  # every weight but a tied head (transformers lists that twice)
    assert all(torch.equal(ours[name].data, tensor) for name, tensor in theirs.items())
    prompt = [(11 * j) % 480 + 20 for j in range(40)]
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert PagedHarness(model).generate(0, prompt, 12) == expected[0, len(prompt) :].tolist()
    assert model.weights_format.startswith("gguf (") and model.weights_format.endswith("dequantized to float32")


def test_the_derived_tokenizer_and_template_are_transformers_reading_of_the_file(files: dict) -> None:
    from deployments.tokenizer import load_tokenizer

    path = files["qwen3"]
    ours = load_tokenizer(checkpoint_folder(path))
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = "Hello, world! <|im_start|>user\nWhat is 2+2?<|im_end|>"
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.chat_template == theirs.chat_template


def test_a_split_set_is_served_from_its_first_file_with_the_same_weights(files: dict, tmp_path: Path) -> None:
    checkpoint = files["llama"].parent / "llama"
    shards = write_gguf(checkpoint, tmp_path / "llama.gguf", "Q8_0", split_max_tensors=5)
    assert len(shards) > 2 and shards[0].name.endswith("-00001-of-0000%d.gguf" % len(shards))
    whole = dict(load_model(checkpoint_folder(files["llama"]), dtype="float32").named_parameters())
    split = dict(load_model(checkpoint_folder(shards[0]), dtype="float32").named_parameters())
    assert whole.keys() == split.keys() and all(torch.equal(whole[n], split[n]) for n in whole)


def test_a_split_set_missing_a_file_is_refused_naming_it(files: dict, tmp_path: Path) -> None:
    from deployments.tokenizer import CheckpointError

    shards = write_gguf(files["llama"].parent / "llama", tmp_path / "llama.gguf", "Q8_0", split_max_tensors=5)
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=f"lacks {shards[-1].name}"):
        checkpoint_folder(shards[0])


@pytest.mark.skipif(not quant_gemm.available(), reason="the native CPU kernels are off on this machine")
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_kept_blocks_are_the_files_bytes_and_rows_do_not_depend_on_the_batch(arch: str, files: dict) -> None:
    model = load_model(checkpoint_folder(files[arch]), dtype="auto")
    assert model.weights_format.endswith("kept quantized")
    kept = {name: p for name, p in model.named_parameters() if getattr(p, "gguf_qtype", None)}
    assert all(p.dtype == torch.uint8 for p in kept.values())
    if arch == "qwen3_moe":  # each layer's expert stacks, [E, N, row bytes]
        assert sum(p.dim() == 3 for p in kept.values()) == 3 * len(model.model.layers)
    else:
        assert kept["model.layers.0.mlp.down_proj.weight"].gguf_qtype in ("Q4_K", "Q6_K")
    prompts = [[(7 * i + 13 * j) % 480 + 20 for j in range(9 + 7 * i)] for i in range(3)]
    batched = PagedHarness(model).step([(i, p) for i, p in enumerate(prompts)])
    alone = [PagedHarness(model).step([(0, p)])[0] for p in prompts]
    assert all(torch.equal(batched[i], alone[i]) for i in range(3))


def test_every_type_read_is_one_gguf_py_dequantizes() -> None:
    import gguf
    import numpy as np

    from deployments.gguf_files.tensors import READ_TYPES

    for name in sorted(READ_TYPES):
        kind = gguf.GGMLQuantizationType[name]
        block, size = gguf.GGML_QUANT_SIZES[kind]
        raw = {"F32": np.zeros((2, 256), np.float32), "F16": np.zeros((2, 256), np.float16)}
        data = raw.get(name, np.zeros((2, size * 256 // block), np.uint8))
        assert gguf.quants.dequantize(data, kind).shape == (2, 256), name


def test_a_file_with_a_type_it_cannot_read_is_refused_before_loading_naming_the_type(
    files: dict, tmp_path: Path
) -> None:
    import gguf
    import numpy as np

    from deployments.model_rank.models import check_checkpoint
    from deployments.tokenizer import CheckpointError

    folder = checkpoint_folder(files["llama"])
    path = tmp_path / "ints.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_norm.weight", np.zeros(64, dtype=np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    odd = tmp_path / "folder"
    odd.mkdir()
    for item in folder.iterdir():
        if item.suffix != ".gguf":
            (odd / item.name).write_bytes(item.read_bytes())
    (odd / path.name).symlink_to(path)
    with pytest.raises(CheckpointError, match="tensor type I32 is not read"):
        check_checkpoint(odd)

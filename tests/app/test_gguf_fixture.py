"""GGUF fixture files: transformers' GGUF loader reads back the source checkpoint; the quantizers' blocks are
valid for gguf-py's dequantizers; split sets carry llama.cpp's split keys."""

import json
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers loads a GGUF model through it

from serve_app.cli import main  # noqa: E402
from serve_app.fixtures.checkpoints import build_random_checkpoint  # noqa: E402
from serve_app.fixtures.cli import GGUF_FILE_TYPES  # noqa: E402
from serve_app.fixtures.gguf_tensors import FILE_TYPES, Layout, tensor_type  # noqa: E402
from serve_app.fixtures.gguf_writer import write_gguf  # noqa: E402
from serve_app.fixtures.k_quants import quantize_k  # noqa: E402
from serve_app.fixtures.tokenizer_builder import build_tokenizer, use_tokenizer_end_token  # noqa: E402

T = gguf.GGMLQuantizationType
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
TEXTS = [
    "<|im_start|>user\nHello, world!<|im_end|>\n<|im_start|>assistant\n<think>x</think>",
    "naïve café 東京 🙂  two  spaces\n\n\ttab",
    'def f(x):\n    return {"a": [1, 2.5, None]}<|endoftext|>',
]
# Each arch's source: llama wide enough (rows of 256) for the K-quants; qwen3_moe with experts in every block,
# as llama.cpp's qwen3moe has them.
SOURCES = {
    "llama": dict(hidden_size=256, intermediate_size=256, head_dim=64),
    "qwen3": {},
    "qwen3_moe": dict(mlp_only_layers=[]),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for arch, overrides in SOURCES.items():
        directory = tmp_path_factory.mktemp(arch)
        build_tokenizer(directory, family="qwen")
        build_random_checkpoint(arch, directory, vocab_size=520, **overrides)  # 8 ids past the tokenizer's
        (directory / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
        out[arch] = use_tokenizer_end_token(directory)
    return out


def _load(path: Path):
    """transformers' config and model of a GGUF file. Its GGUF loader reads no head size for qwen3 and no
    expert width for qwen3_moe: those come from the file's own keys, checked against the source below."""
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.head_dim = reader.fields[f"{arch}.attention.key_length"].contents()
    if f"{arch}.expert_feed_forward_length" in reader.fields:
        config.moe_intermediate_size = reader.fields[f"{arch}.expert_feed_forward_length"].contents()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float32
    )
    return config, model.state_dict()


def _source_weights(source: Path) -> dict:
    return transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()


@pytest.mark.parametrize("arch", sorted(SOURCES))
def test_an_f32_file_reads_back_as_the_source_config_tokenizer_template_and_exact_weights(sources, tmp_path, arch):
    source = sources[arch]
    (path,) = write_gguf(source, tmp_path / "model.gguf", "F32")
    config, weights = _load(path)
    expected = transformers.AutoConfig.from_pretrained(source)
    fields = ["model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads"]
    fields += ["num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size", "tie_word_embeddings"]
    fields += ["bos_token_id", "eos_token_id"]
    if arch == "qwen3_moe":
        fields += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"]
    assert {f: getattr(config, f) for f in fields} == {f: getattr(expected, f) for f in fields}
    assert config.rope_parameters["rope_theta"] == expected.rope_parameters["rope_theta"]
    assert config.rms_norm_eps == pytest.approx(expected.rms_norm_eps, rel=1e-6)  # stored as float32

    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    source_tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    assert [tokenizer.encode(t) for t in TEXTS] == [source_tokenizer.encode(t) for t in TEXTS]
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.chat_template == TEMPLATE

    source_weights = _source_weights(source)
    assert weights.keys() == source_weights.keys()
    assert all(torch.equal(weights[name], source_weights[name]) for name in source_weights)


# The largest error of a value, as a share of its tensor's largest magnitude, per stored type: half a step
# of the type's grid over a row's range, with room for the rounded scales.
_RELATIVE_ERROR = {T.F32: 0.0, T.Q8_0: 1 / 254 * 1.15, T.Q6_K: 1 / 64 * 1.15, T.Q4_K: 1 / 15 * 1.15}


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_a_q4_k_m_file_reads_back_within_its_tensor_types_error(sources, tmp_path, arch):
    (path,) = write_gguf(sources[arch], tmp_path / "model.gguf", "Q4_K_M")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    if arch == "llama":  # rows of 256: llama.cpp's mix
        assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_up.weight"] == types["blk.0.attn_v.weight"] == T.Q4_K
        # of two layers, the last (from 7/8 of the stack on) gets more bits
        assert types["output.weight"] == types["blk.1.attn_v.weight"] == types["blk.1.ffn_down.weight"] == T.Q6_K
    else:  # rows of 64 or 32 values fit no K-quant block: Q8_0
        assert types["blk.0.ffn_down_exps.weight"] == types["output.weight"] == T.Q8_0
        assert types["blk.0.ffn_gate_inp.weight"] == T.F32
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == T.F32

    _, weights = _load(path)
    source_weights = _source_weights(sources[arch])
    assert weights.keys() == source_weights.keys()
    worst = max(_RELATIVE_ERROR[kind] for kind in types.values())  # names differ: bound by the coarsest type
    for name, expected in source_weights.items():
        bound = worst * float(expected.abs().max())
        assert float((weights[name] - expected).abs().max()) <= bound, name


def _test_rows() -> np.ndarray:
    rng = np.random.default_rng(0)
    outliers = rng.standard_normal(512) * 0.01
    outliers[::97] = 5.0
    rows = [
        rng.standard_normal(512),
        np.zeros(512),
        -np.abs(rng.standard_normal(512)),
        rng.uniform(0.0, 1.0, 512),
        np.full(512, 0.25),
        outliers,
        rng.standard_normal(512) * np.repeat(10.0 ** rng.uniform(-3, 1, 32), 16),  # scales vary by sub-block
    ]
    return np.stack(rows).astype(np.float32)


# Half a step of each grid over a super-block's range (twice its largest magnitude; Q6_K's grid is signed),
# with room for the 6- or 8-bit scales' rounding.
_K_BOUNDS = {"Q4_K": 1 / 15, "Q5_K": 1 / 31, "Q6_K": 1 / 64}


@pytest.mark.parametrize("type_name", sorted(_K_BOUNDS))
def test_k_quant_blocks_dequantize_within_half_a_step_of_the_input(type_name):
    rows = _test_rows()
    restored = gguf.quants.dequantize(quantize_k(rows, type_name), T[type_name])
    error = np.abs(restored - rows).reshape(len(rows), -1, 256).max(axis=-1)
    largest = np.abs(rows).reshape(len(rows), -1, 256).max(axis=-1)
    assert (error <= _K_BOUNDS[type_name] * 1.15 * largest).all()
    assert (restored[1] == 0).all()


@pytest.mark.parametrize("type_name", sorted(_K_BOUNDS))
def test_a_k_quant_row_alone_equals_the_row_in_a_batch(type_name):
    rows = _test_rows()
    assert np.array_equal(quantize_k(rows[3:4], type_name)[0], quantize_k(rows, type_name)[3])


def test_a_row_that_fits_no_block_falls_back_to_q8_0_then_f16():
    layout = Layout(gguf.MODEL_ARCH.LLAMA, 2, 4, 2, permute_qk=True, tied=False)
    assert tensor_type("blk.0.attn_q.weight", (64, 256), "Q4_K_M", layout) == T.Q4_K
    assert tensor_type("blk.0.attn_q.weight", (64, 96), "Q4_K_M", layout) == T.Q8_0
    assert tensor_type("blk.0.attn_q.weight", (64, 48), "Q4_0", layout) == T.F16
    assert tensor_type("output.weight", (64, 256), "Q4_0", layout) == T.Q6_K
    assert tensor_type("output.weight", (64, 256), "Q8_0", layout) == T.Q8_0
    assert tensor_type("blk.0.attn_norm.weight", (64,), "BF16", layout) == T.F32
    assert GGUF_FILE_TYPES == tuple(FILE_TYPES)


def test_a_split_set_carries_the_split_keys_and_together_holds_every_tensor(sources, tmp_path, capsys):
    whole = gguf.GGUFReader(write_gguf(sources["qwen3"], tmp_path / "whole.gguf", "Q8_0")[0])
    assert main(["fixture", "gguf", str(sources["qwen3"]), str(tmp_path / "set.gguf"), "--type", "Q8_0",
                 "--split-max-tensors", "8"]) == 0  # fmt: skip
    count = -(-len(whole.tensors) // 8)
    paths = [tmp_path / f"set-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    assert str(paths[-1]) in capsys.readouterr().out
    shards = [gguf.GGUFReader(path) for path in paths]
    for index, shard in enumerate(shards):
        assert shard.fields["split.no"].contents() == index
        assert shard.fields["split.count"].contents() == count
        assert shard.fields["split.tensors.count"].contents() == len(whole.tensors)
        assert 0 < len(shard.tensors) <= 8
        assert ("qwen3.block_count" in shard.fields) == (index == 0)
        assert ("tokenizer.ggml.tokens" in shard.fields) == (index == 0)
    pieces = {t.name: (t.tensor_type, bytes(t.data)) for shard in shards for t in shard.tensors}
    assert pieces == {t.name: (t.tensor_type, bytes(t.data)) for t in whole.tensors}


@pytest.mark.parametrize(
    ("model_type", "config", "message"),
    [
        ("glm4_moe", {}, "model_type 'glm4_moe'"),
        ("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers"),
    ],
)
def test_the_writer_refuses_what_llama_cpp_has_no_layout_for(tmp_path, model_type, config, message):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **config}))
    with pytest.raises(ValueError, match=message):
        write_gguf(tmp_path, tmp_path / "model.gguf", "Q8_0")

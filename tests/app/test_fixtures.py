"""The offline fixtures: the trained-in-seconds tokenizer, the tiny-glm template, and the committed tiny-glm."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from deployments.tokenizer import load_tokenizer  # noqa: E402
from serve_app.fixtures import tokenizer_builder  # noqa: E402
from serve_app.fixtures.checkpoints import BENCH_SHAPES, TINY, mrope_parameters  # noqa: E402
from serve_app.fixtures.tiny_glm import BUILTIN_DIR, TEMPLATE_PATH  # noqa: E402
from serve_app.fixtures.tiny_glm.corpus import COMPLETIONS, CONVERSATIONS, TOOLS  # noqa: E402
from serve_app.fixtures.tokenizer_builder import FAMILIES, build_tokenizer  # noqa: E402

TEXTS = [
    "naïve café 東京 🙂",
    "Hello, world!\n\tIndented line with  two spaces.",
    'def f(x):\n    return {"a": [1, 2.5, None], "é": "ü"}',
    "",
    "\u00a0\u200b zero width and \x00 nul",
]


@pytest.fixture(scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model runs fastest on one thread, and CI has two cores
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(BUILTIN_DIR)


@pytest.fixture(scope="module")
def hf_model(one_thread):
    return transformers.AutoModelForCausalLM.from_pretrained(BUILTIN_DIR).eval()


def _render(hf_tokenizer, messages: list[dict], **kwargs) -> str:
    return hf_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


# --- tokenizer builder ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tokenizer_round_trips_any_text(tmp_path: Path, family: str) -> None:
    bundle = load_tokenizer(build_tokenizer(tmp_path, family=family))
    for text in TEXTS:
        assert bundle.decode(bundle.encode(text)) == text


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_control_tokens_are_single_ids_in_both_loaders(tmp_path: Path, family: str) -> None:
    build_tokenizer(tmp_path, family=family, vocab_size=400)
    ours = load_tokenizer(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tokens = FAMILIES[family].special + FAMILIES[family].markup
    for token in tokens:
        token_id = ours.token_to_id(token)
        assert ours.encode(token) == [token_id]
        assert theirs.encode(token, add_special_tokens=False) == [token_id]
    assert len(set(map(ours.token_to_id, tokens))) == len(tokens)
    assert ours.vocab_size == len(theirs) == 400
    assert ours.eos_token == theirs.eos_token == FAMILIES[family].eos_token
    assert ours.bos_token is None and theirs.bos_token is None
    assert ours.encode(tokens[0] + "x")[0] == ours.token_to_id(tokens[0])  # a control token ahead of text


def test_markup_tokens_survive_skip_special_tokens(tmp_path: Path) -> None:
    # The reply parser finds reasoning and tool calls in decoded text, so those tokens must stay visible.
    bundle = load_tokenizer(build_tokenizer(tmp_path))
    ids = bundle.encode("<think>r</think>a<tool_call>f</tool_call><|user|>")
    assert bundle.decode(ids, skip_special_tokens=True) == "<think>r</think>a<tool_call>f</tool_call>"


def test_build_is_deterministic_across_processes(tmp_path: Path) -> None:
    corpus = ["What is the weather in Paris?", "It is sunny in Paris, 18 °C."]
    build_tokenizer(tmp_path / "here", vocab_size=600, corpus=corpus)
    # Loaded by path, not through the package, whose __init__ imports torch (seconds of startup).
    script = (
        "import importlib.util, sys; "
        "spec = importlib.util.spec_from_file_location('builder', sys.argv[1]); "
        "builder = importlib.util.module_from_spec(spec); spec.loader.exec_module(builder); "
        f"builder.build_tokenizer(sys.argv[2], vocab_size=600, corpus={corpus!r})"
    )
    env = {"PYTHONHASHSEED": "12345", "PATH": ""}  # another hash seed: set iteration order must not leak
    args = [sys.executable, "-c", script, tokenizer_builder.__file__, str(tmp_path / "there")]
    subprocess.run(args, check=True, env=env)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "here" / name).read_bytes() == (tmp_path / "there" / name).read_bytes()


def test_tokenizer_config_declares_the_added_tokens(tmp_path: Path) -> None:
    config = json.loads((build_tokenizer(tmp_path) / "tokenizer_config.json").read_text())
    assert "chat_template" not in config
    assert config["bos_token"] is None and config["eos_token"] == config["pad_token"] == "<|endoftext|>"
    decoded = {entry["content"]: entry["special"] for entry in config["added_tokens_decoder"].values()}
    assert decoded["<|assistant|>"] is True and decoded["<think>"] is False


# --- the chat template ---------------------------------------------------------------------------------


def test_template_renders_a_plain_conversation(hf_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": [{"type": "text", "text": "Use English."}]},
        {"role": "user", "content": "Hi"},
    ]
    on = _render(hf_tokenizer, messages, add_generation_prompt=True)
    off = _render(hf_tokenizer, messages, add_generation_prompt=True, enable_thinking=False)
    assert on == "[gMASK]<sop><|system|>Be brief.<|system|>Use English.<|user|>Hi<|assistant|>"
    assert off == on + "<think></think>"
    assert _render(hf_tokenizer, messages) == on.removesuffix("<|assistant|>")


def test_template_lists_tools_in_the_system_part(hf_tokenizer) -> None:
    text = _render(hf_tokenizer, [{"role": "user", "content": "Hi"}], tools=TOOLS, add_generation_prompt=True)
    system, rest = text.split("<|user|>")
    assert system.startswith("[gMASK]<sop><|system|>")
    for tool in TOOLS:
        assert json.dumps(tool, ensure_ascii=False) in system
    assert rest == "Hi<|assistant|>"


def test_template_keeps_reasoning_of_every_turn(hf_tokenizer) -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "first"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "<think>second</think>d"},
        {"role": "user", "content": "e"},
        {"role": "assistant", "content": "f"},
    ]
    assert _render(hf_tokenizer, messages) == (
        "[gMASK]<sop><|user|>a<|assistant|><think>first</think>b<|user|>c"
        "<|assistant|><think>second</think>d<|user|>e<|assistant|><think></think>f"
    )


def _call(arguments) -> list[dict]:
    call = {"type": "function", "function": {"name": "f", "arguments": arguments}}
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]


def test_template_renders_tool_calls_from_dict_and_json_string_arguments(hf_tokenizer) -> None:
    arguments = {"city": 'Paris, "FR" \\ 東京 🙂\n', "days": 3, "exact": True, "none": None, "opts": {"a": [1, 2]}}
    expected = (
        '<tool_call>f<arg_key>city</arg_key><arg_value>Paris, "FR" \\ 東京 🙂\n</arg_value>'
        "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>exact</arg_key><arg_value>true</arg_value>"
        "<arg_key>none</arg_key><arg_value>null</arg_value>"
        '<arg_key>opts</arg_key><arg_value>{"a": [1, 2]}</arg_value></tool_call>'
    )
    from_dict = _render(hf_tokenizer, _call(arguments))
    assert from_dict.endswith("<|assistant|><think></think>" + expected)
    # OpenAI clients send arguments as a JSON string, often with non-ASCII escaped as \uXXXX.
    for ensure_ascii in (True, False):
        assert _render(hf_tokenizer, _call(json.dumps(arguments, ensure_ascii=ensure_ascii))) == from_dict
    assert _render(hf_tokenizer, _call({})).endswith("<tool_call>f</tool_call>")


def test_template_groups_tool_results_under_one_observation(hf_tokenizer) -> None:
    messages = [
        *_call({"x": 1}),
        {"role": "tool", "content": "one"},
        {"role": "tool", "content": [{"type": "text", "text": "two"}]},
        {"role": "user", "content": "next"},
        {"role": "tool", "content": "three"},
    ]
    text = _render(hf_tokenizer, messages, add_generation_prompt=True, enable_thinking=True)
    assert text.endswith(
        "</tool_call><|observation|><tool_response>one</tool_response><tool_response>two</tool_response>"
        "<|user|>next<|observation|><tool_response>three</tool_response><|assistant|>"
    )


def test_template_rejects_unknown_roles(hf_tokenizer) -> None:
    with pytest.raises(Exception, match="no role named narrator"):
        _render(hf_tokenizer, [{"role": "narrator", "content": "x"}])


def test_committed_template_is_the_package_template() -> None:
    assert (BUILTIN_DIR / "chat_template.jinja").read_text() == TEMPLATE_PATH.read_text()


def test_each_turn_extends_the_previous_prompt_and_reply(hf_tokenizer) -> None:
    # GLM ends a reply with the next role token, so prompt + reply is a prefix of the next turn's prompt.
    by_name = {c.name: c for c in CONVERSATIONS}
    pairs = [
        ("weather_call", "weather_answer"),
        ("weather_call_thinking", "weather_answer_thinking"),
        ("parallel_calls", "parallel_answer"),
        ("add_call", "add_answer"),
    ]
    for first, second in pairs:
        a, b = by_name[first], by_name[second]
        prompt_a = _render(hf_tokenizer, a.messages, add_generation_prompt=True, **a.template_kwargs())
        prompt_b = _render(hf_tokenizer, b.messages, add_generation_prompt=True, **b.template_kwargs())
        assert prompt_b.startswith(prompt_a + a.reply), first


# --- the committed tiny-glm ----------------------------------------------------------------------------


def test_committed_checkpoint_is_small_and_complete() -> None:
    files = {p.name for p in BUILTIN_DIR.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "README.md",
    } <= files
    assert sum(p.stat().st_size for p in BUILTIN_DIR.iterdir()) <= 10 * 2**20
    config = json.loads((BUILTIN_DIR / "config.json").read_text())
    assert config["model_type"] == "glm4_moe" and config["num_nextn_predict_layers"] == 1
    bundle = load_tokenizer(BUILTIN_DIR)
    ends = [bundle.token_to_id(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    assert bundle.eos_token_ids == ends == config["eos_token_id"]
    assert bundle.chat_template == TEMPLATE_PATH.read_text()


def test_our_loader_and_transformers_give_the_same_ids(hf_tokenizer) -> None:
    bundle = load_tokenizer(BUILTIN_DIR)
    for c in CONVERSATIONS:
        text = _render(hf_tokenizer, c.messages, add_generation_prompt=True, **c.template_kwargs()) + c.reply
        ids = bundle.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
        assert bundle.decode(ids) == text


def _prompt_ids(hf_tokenizer, conversation) -> list[int]:
    return hf_tokenizer.apply_chat_template(
        conversation.messages,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **conversation.template_kwargs(),
    )


def test_tiny_glm_greedily_writes_every_scripted_reply(hf_tokenizer, hf_model) -> None:
    prompts = [(c.name, _prompt_ids(hf_tokenizer, c), c.reply) for c in CONVERSATIONS]
    prompts += [
        (c.prompt, hf_tokenizer.encode(c.prompt, add_special_tokens=False), c.continuation) for c in COMPLETIONS
    ]
    wrong = {}
    with torch.no_grad():
        for name, ids, reply in prompts:
            prompt = torch.tensor([ids])
            out = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=96)
            text = hf_tokenizer.decode(out[0, prompt.shape[1] :])
            if text != reply:
                wrong[name] = text
    assert not wrong


def test_mtp_layer_has_glm_layout_and_drafts_the_replies(hf_tokenizer, hf_model) -> None:
    from safetensors import safe_open
    from transformers.modeling_layers import MtpModel

    with safe_open(BUILTIN_DIR / "model.safetensors", "pt") as weights:
        keys = set(weights.keys())
    moe_layer = {k.removeprefix("model.layers.1.") for k in keys if k.startswith("model.layers.1.")}
    mtp_layer = {k.removeprefix("model.layers.2.") for k in keys if k.startswith("model.layers.2.")}
    extras = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight"}
    assert mtp_layer == moe_layer | extras

    # transformers finds MTP weights by the layer numbers of real GLM checkpoints; tell it ours.
    hf_model._keys_to_ignore_on_load_unexpected = [r"model\.layers\.2\..*"]
    mtp = MtpModel.from_pretrained(hf_model).eval()  # raises if a weight is missing
    right = total = 0
    with torch.no_grad():
        for c in CONVERSATIONS:
            prompt = _prompt_ids(hf_tokenizer, c)
            ids = torch.tensor([prompt + hf_tokenizer.encode(c.reply, add_special_tokens=False)])
            hidden = hf_model.model(ids).last_hidden_state
            positions = torch.arange(1, ids.shape[1]).unsqueeze(0)
            drafted = mtp.forward_layer(0, hidden[:, :-1], positions, None, input_ids=ids[:, 1:])
            guesses = mtp._project_to_logits(drafted)[0].argmax(-1)  # row t guesses token t+2
            start = len(prompt) - 2  # first row whose guess is a reply token
            right += int((guesses[start:-1] == ids[0, start + 2 :]).sum())
            total += ids.shape[1] - 2 - start
    assert right / total >= 0.95


def test_mtp_layer_chains_drafts_as_the_engine_does(hf_tokenizer, hf_model) -> None:
    # The engine drafts several tokens a round by feeding the MTP layer its own draft and output again.
    from safetensors.torch import load_file

    from serve_app.fixtures.tiny_glm.data import corpus_examples, tokenize_examples
    from serve_app.fixtures.tiny_glm.mtp import load_mtp
    from serve_app.fixtures.tiny_glm.mtp_chain import engine_acceptance

    mtp = load_mtp(hf_model, load_file(BUILTIN_DIR / "model.safetensors"))
    examples = tokenize_examples(hf_tokenizer, corpus_examples(TEMPLATE_PATH.read_text(encoding="utf-8")))
    acceptance = engine_acceptance(hf_model, mtp, examples, depth=3)
    assert acceptance.anchors[0] == sum(len(e.reply_ids) for e in examples)  # every reply token is guessed once
    assert min(acceptance.accepted) >= 0.95, acceptance


def test_vision_checkpoint_names_its_markers_and_preprocessing(tmp_path: Path) -> None:
    """The multimodal fixture: config ids are the tokenizer's markers, and transformers' image processor reads
    its preprocessor config into the tiny tower's patches."""
    import numpy as np
    from PIL import Image
    from transformers import AutoConfig, AutoImageProcessor

    out = tmp_path / "qwen3_5"
    subprocess.run(
        [sys.executable, "-m", "serve_app.cli", "fixture", "checkpoint", str(out), "--arch", "qwen3_5"],
        check=True,
        capture_output=True,
    )
    config = AutoConfig.from_pretrained(out)
    tokenizer = load_tokenizer(out).tokenizer
    assert tokenizer.token_to_id("<|image_pad|>") == config.image_token_id
    assert tokenizer.token_to_id("<|vision_start|>") == config.vision_start_token_id
    image = Image.fromarray(np.zeros((40, 52, 3), dtype=np.uint8))
    patches = AutoImageProcessor.from_pretrained(out)(images=[image], return_tensors="np")
    # 40 x 52 rounds to multiples of 8 (a merged 2 x 2 of 4-pixel patches), 40 x 48: 10 x 12 patches, each
    # 3 channels x 2 frames x 4 x 4 values (Python rounds 6.5 to even)
    assert patches["image_grid_thw"].tolist() == [[1, 10, 12]]
    assert patches["pixel_values"].shape == (120, 96)


SHAPES = {
    **{f"tiny {arch}": shape for arch, shape in TINY.items()},
    **{s: shape for s, (_, shape) in BENCH_SHAPES.items()},
}


@pytest.mark.parametrize("name", [n for n, s in SHAPES.items() if "mrope_section" in str(s)])
def test_every_shape_s_mrope_sections_split_its_rotary_pairs(name: str) -> None:
    text = SHAPES[name].get("text_config", SHAPES[name])
    rope = text["rope_parameters"]
    pairs = int(text["head_dim"] * rope["partial_rotary_factor"]) // 2
    assert sum(rope["mrope_section"]) == pairs, rope  # what the loader checks (layers/rotary.py)


def test_mrope_sections_split_as_qwen3_5_s_own() -> None:
    assert mrope_parameters(256, 1e7)["mrope_section"] == [11, 11, 10]  # Qwen3.5's head of 256, 32 pairs

"""config.json keys on tiny checkpoints: a key left out is read as transformers reads it (greedy ids equal
transformers' on the same config), and a value no step could run is refused when the model loads, one
line naming the key, never on the first request that reaches it (docs/engine.md, Architectures)."""

from collections.abc import Callable
from pathlib import Path

import pytest

from deployments.model_rank.models import check_checkpoint, load_model
from deployments.tokenizer import CheckpointError
from serve_app.fixtures.checkpoints import build_random_checkpoint
from tests.support.config_edits import with_config
from tests.support.model_harness import PagedHarness
from tests.support.reference import hf_greedy

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/rank/conftest.py

PROMPT, NEW_TOKENS = [(7 * j) % 500 + 2 for j in range(24)], 12
ARCHS = (
    *("qwen3", "qwen3_moe", "glm4_moe", "glm4_moe_lite", "nemotron_h", "qwen3_next", "qwen3_5", "gemma4_text"),
    *("glm_moe_dsa", "glm5_next"),
)
Edit = Callable[[dict], None]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("config-keys")
    return {arch: build_random_checkpoint(arch, root / arch) for arch in ARCHS}


def _set(**values: object) -> Edit:
    return lambda config: config.update(values)


def _drop(*keys: str) -> Edit:
    return lambda config: [config.pop(key) for key in keys]


def _text(edit: Edit) -> Edit:
    return lambda config: edit(config["text_config"])


def _text_rope(**values: object) -> Edit:
    return _text(lambda text: text["rope_parameters"].update(values))


def _vision_rope(**values: object) -> Edit:
    return lambda config: config["vision_config"].setdefault("rope_parameters", {}).update(values)


# Each was served before and failed on every step (or request) that reached it; the pattern names the key.
REFUSED: dict[str, tuple[str, Edit, str]] = {
    "glm experts split into unequal groups": ("glm4_moe", _set(n_group=3), r"n_group \(3\) must divide"),
    "glm more top groups than groups": ("glm4_moe", _set(topk_group=3), r"topk_group \(3\) must be between"),
    "glm more experts per token than experts": ("glm4_moe", _set(num_experts_per_tok=9), "num_experts_per_tok"),
    "glm-lite groups of one expert": ("glm4_moe_lite", _set(n_group=8), r"n_group \(8\) leaves groups of one"),
    "nemotron no expert per token": ("nemotron_h", _set(num_experts_per_tok=0), r"num_experts_per_tok \(0\)"),
    "qwen3_moe top-k past the experts": ("qwen3_moe", _set(num_experts_per_tok=9), r"num_experts \(8\)"),
    "qwen3_next top-k past the experts": ("qwen3_next", _set(num_experts_per_tok=9), r"num_experts \(8\)"),
    "qwen3 query heads in uneven groups": ("qwen3", _set(num_key_value_heads=3), r"num_key_value_heads \(3\)"),
    "qwen3 gelu MLP": ("qwen3", _set(hidden_act="gelu"), "hidden_act 'gelu'"),
    "glm gelu MLP": ("glm4_moe", _set(hidden_act="gelu"), "hidden_act 'gelu'"),
    "qwen3_5 two mrope sections": ("qwen3_5", _text_rope(mrope_section=[2, 2]), "rope_parameters.mrope_section"),
    "qwen3_5 vision yarn": ("qwen3_5", _vision_rope(rope_type="yarn"), "vision_config.rope_parameters.rope_type"),
    "gemma4 more experts per token than experts": (
        "gemma4_text",
        _set(enable_moe_block=True, num_experts=4, top_k_experts=5, moe_intermediate_size=32),
        r"top_k_experts \(5\)",
    ),
    "gemma4 bidirectional text": (
        "gemma4_text",
        _set(use_bidirectional_attention="all"),
        "use_bidirectional_attention",
    ),
    "gemma4 silu MLP": ("gemma4_text", _set(hidden_activation="silu"), "hidden_activation 'silu'"),
    "gemma4 yarn on full layers": (
        "gemma4_text",
        lambda config: config["rope_parameters"]["full_attention"].update(rope_type="yarn"),
        "rope_parameters.full_attention",
    ),
    "gemma4 shared layers with no source": ("gemma4_text", _set(num_kv_shared_layers=5), "num_kv_shared_layers"),
    "gemma4 empty window": ("gemma4_text", _set(sliding_window=-1), "sliding_window"),
    "glm-5 shared indexer first": (
        "glm_moe_dsa",
        _set(indexer_types=["shared", "full", "full"]),
        r"indexer_types\[0\]",
    ),
    "glm-5 no q latent": ("glm_moe_dsa", _set(q_lora_rank=None), "q_lora_rank"),
    "glm-5-flash unknown layer kind": (
        "glm5_next",
        _text(_set(layer_types=["linear_attention", "sliding_attention", "indexed_attention", "linear_attention"])),
        "layer_types",
    ),
    "glm-5-flash shared indexer after kda": (
        "glm5_next",
        _text(
            _set(
                layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
                indexer_types=["full", "full", "full", "shared"],
            )
        ),
        r"indexer_types\[3\]",
    ),
    "glm-5-flash rotary mla": ("glm5_next", _text(_set(qk_rope_head_dim=8)), "qk_rope_head_dim"),
    "glm-5-flash pools not dividing the budget": ("glm5_next", _text(_set(index_kpool=5)), "index_kpool"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unservable_config_values_are_refused_at_load_naming_the_key(
    case: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    arch, edit, pattern = REFUSED[case]
    bad = with_config(checkpoints[arch], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=pattern) as refused:
        check_checkpoint(bad)  # what `tensorfold serve` runs before Ray starts
    assert str(refused.value).startswith(f"{bad / 'config.json'}: ") and "\n" not in str(refused.value)
    with pytest.raises(CheckpointError, match=pattern):
        load_model(bad)


# Keys left out (or spelled as transformers also reads them) that were refused or ignored before.
DEFAULTED: dict[str, tuple[str, Edit]] = {
    "glm-lite experts per token": ("glm4_moe_lite", _drop("num_experts_per_tok")),  # transformers: 4 of the 8
    "glm experts per token": ("glm4_moe", lambda c: c.update(n_group=1) or c.pop("num_experts_per_tok")),  # all 8
    "qwen3 swish": ("qwen3", _set(hidden_act="swish")),
    # transformers' schedules for the fixture's full, shared, full: every second layer from the first, or a pattern.
    "glm-5 indexer schedule": (
        "glm_moe_dsa",
        lambda c: c.pop("indexer_types") and c.update(index_topk_freq=2, index_skip_topk_offset=1),
    ),
    "glm-5 indexer pattern": ("glm_moe_dsa", lambda c: c.pop("indexer_types") and c.update(index_topk_pattern="FSF")),
    "glm-5-flash full_attention layers": (
        "glm5_next",
        _text(_set(layer_types=["linear_attention", "full_attention", "full_attention", "linear_attention"])),
    ),
    "gemma4 rope left out": ("gemma4_text", _drop("rope_parameters")),  # full layers: proportional, a quarter
    # The full layers' shape as the keys transformers folds into per_layer_config when it builds a config.
    "gemma4 global head keys": (
        "gemma4_text",
        lambda c: c.pop("per_layer_config") and c.update(global_head_dim=32, num_global_key_value_heads=1),
    ),
}


@pytest.mark.parametrize("case", DEFAULTED)
def test_keys_left_out_are_read_as_transformers_reads_them(
    case: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    arch, edit = DEFAULTED[case]
    path = with_config(checkpoints[arch], tmp_path / "edited", edit)
    model = load_model(path, dtype="float32")
    assert PagedHarness(model).generate(0, PROMPT, NEW_TOKENS) == hf_greedy(path, PROMPT, NEW_TOKENS)

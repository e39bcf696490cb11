"""Sliding-window families over the real routes (in-process renderer and engine): greedy token ids over HTTP
equal transformers' on tiny random checkpoints (Gemma 4: a 16-token window, shared KV, per-layer inputs; the
image-text checkpoint's text model; the expert block beside every MLP), the 60-token prompt whole and in
7-token chunks, on the torch rank and the MLX rank (where mlx imports)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from serve_app.fixtures.archs import WINDOW_ARCHS, tokenizer_family
from serve_app.fixtures.checkpoints import build_random_checkpoint
from serve_app.fixtures.tokenizer_builder import build_tokenizer
from tests.support.local_app import greedy_ids_over_http
from tests.support.reference import hf_greedy

pytest.importorskip("transformers")
PROMPT_LEN, NEW_TOKENS = 60, 24
NO_MLX = pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx is not installed")
BACKENDS = ["torch", pytest.param("mlx", marks=NO_MLX)]
EXPERTS = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
CHECKPOINTS = {arch: (arch, {}) for arch in WINDOW_ARCHS} | {"gemma4_text-experts": ("gemma4_text", EXPERTS)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("window-http")
    made = {}
    for name, (arch, overrides) in CHECKPOINTS.items():
        made[name] = build_random_checkpoint(arch, root / name, **overrides)
        build_tokenizer(made[name], family=tokenizer_family(arch))
    return made


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", CHECKPOINTS)
def test_greedy_ids_over_http_equal_transformers(arch: str, backend: str, checkpoints: dict[str, Path]) -> None:
    prompt = torch.randint(2, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(11)).tolist()
    expected = hf_greedy(checkpoints[arch], prompt, NEW_TOKENS)
    for chunk in (512, 7):
        settings = dict(window=128, dtype="float32", prefill_chunk_size=chunk, backend=backend)
        assert greedy_ids_over_http(str(checkpoints[arch]), prompt, NEW_TOKENS, **settings) == expected, chunk

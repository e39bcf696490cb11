"""DeepSeek-sparse-attention families over the real routes (in-process renderer and engine): greedy token ids
over HTTP equal transformers' on tiny random checkpoints (GLM-5.3 and GLM-5.3-Flash, indexers keeping 32
tokens per query), a 100-token prompt whole and in 7-token chunks, on the torch rank and the MLX rank (where
mlx imports)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from serve_app.fixtures.archs import DSA_ARCHS, tokenizer_family
from serve_app.fixtures.checkpoints import build_random_checkpoint
from serve_app.fixtures.tokenizer_builder import build_tokenizer
from tests.support.local_app import greedy_ids_over_http
from tests.support.reference import hf_greedy

pytest.importorskip("transformers")
PROMPT_LEN, NEW_TOKENS = 100, 24
NO_MLX = pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx is not installed")
BACKENDS = ["torch", pytest.param("mlx", marks=NO_MLX)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dsa-http")
    made = {}
    for arch in DSA_ARCHS:
        made[arch] = build_random_checkpoint(arch, root / arch)
        build_tokenizer(made[arch], family=tokenizer_family(arch))
    return made


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_greedy_ids_over_http_equal_transformers(arch: str, backend: str, checkpoints: dict[str, Path]) -> None:
    prompt = torch.randint(2, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(11)).tolist()
    expected = hf_greedy(checkpoints[arch], prompt, NEW_TOKENS)
    for chunk in (512, 7):
        settings = dict(window=256, dtype="float32", prefill_chunk_size=chunk, backend=backend)
        assert greedy_ids_over_http(str(checkpoints[arch]), prompt, NEW_TOKENS, **settings) == expected, chunk

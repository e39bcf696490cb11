"""Hybrid families over the real routes (in-process renderer and engine): greedy token ids over HTTP equal
transformers' on a tiny random checkpoint of each, the prompt whole and in 7-token chunks, on the torch rank
and the MLX rank (where mlx imports), and the replica reports its recurrent-state slots in /health and
/memory."""

import importlib.util
from pathlib import Path

import pytest
import torch

from serve_app.fixtures.archs import HYBRID_ARCHS
from serve_app.fixtures.checkpoints import build_random_checkpoint
from serve_app.fixtures.tokenizer_builder import build_tokenizer
from tests.support.local_app import greedy_ids_over_http, local_client
from tests.support.reference import hf_greedy

pytest.importorskip("transformers")
PROMPT_LEN, NEW_TOKENS = 40, 24
NO_MLX = pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx is not installed")
BACKENDS = ["torch", pytest.param("mlx", marks=NO_MLX)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid-http")
    made = {}
    for arch in HYBRID_ARCHS:
        made[arch] = build_random_checkpoint(arch, root / arch)
        build_tokenizer(made[arch], family="qwen")
    return made


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_greedy_ids_over_http_equal_transformers(arch: str, backend: str, checkpoints: dict[str, Path]) -> None:
    prompt = torch.randint(2, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(11)).tolist()
    expected = hf_greedy(checkpoints[arch], prompt, NEW_TOKENS)
    for chunk in (512, 7):
        settings = dict(window=128, dtype="float32", prefill_chunk_size=chunk, backend=backend)
        ids = greedy_ids_over_http(str(checkpoints[arch]), prompt, NEW_TOKENS, **settings)
        assert ids == expected, f"prefill chunks of {chunk}"


def test_health_and_memory_count_the_state_slots(checkpoints: dict[str, Path]) -> None:
    with local_client(str(checkpoints["qwen3_next"]), window=128, dtype="float32") as client:
        body = {"model": "tiny", "prompt": list(range(20, 60)), "max_tokens": 8, "temperature": 0}
        assert client.post("/v1/completions", json=body).status_code == 200
        slots = client.get("/health").json()["state_slots"]
        assert slots["total"] > 0 and slots["used"] == 0 and slots["snapshots"] >= 1  # the prompt's and reply's
        replica = client.get("/memory").json()["replicas"][0]
        assert replica["state_slots_total"] == slots["total"] and replica["state_bytes_per_slot"] > 0
        assert replica["ranks"][0]["state_pool_bytes"] == slots["total"] * replica["state_bytes_per_slot"]

"""The MLX rank (--backend mlx) through the real routes, in-process: greedy ids equal transformers' on every
architecture, the keyed draw shared with torch, tiny-glm's scripted replies, its memory figures, and the
settings it refuses at startup. Linux runs MLX's CPU build; a Mac runs the same code on Metal."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deployments.config import EngineConfig, StartupError
from deployments.model_rank.backend import MLX_INSTALL, resolve_backend
from serve_app.fixtures.archs import ARCHS
from serve_app.fixtures.checkpoints import build_random_checkpoint
from serve_app.fixtures.tiny_glm.corpus import CONVERSATIONS
from serve_app.fixtures.tokenizer_builder import build_tokenizer
from tests.conftest import REPO
from tests.support.local_app import greedy_ids_over_http, local_client
from tests.support.reference import hf_greedy

mx = pytest.importorskip("mlx.core")
transformers = pytest.importorskip("transformers")
PROMPT_LEN, NEW_TOKENS = 64, 32


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mlx-parity")
    made = {}
    for arch in ARCHS:
        made[arch] = build_random_checkpoint(arch, root / arch)
        build_tokenizer(made[arch], family="qwen")
    return made


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_ids_over_http_equal_transformers(arch: str, checkpoints: dict[str, Path]) -> None:
    prompt = torch.randint(2, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()
    expected = hf_greedy(checkpoints[arch], prompt, NEW_TOKENS)
    for chunk in (512, 7):  # the prompt whole, and in 7-token chunks
        settings = dict(window=256, backend="mlx", dtype="float32", prefill_chunk_size=chunk)
        assert greedy_ids_over_http(str(checkpoints[arch]), prompt, NEW_TOKENS, **settings) == expected


def test_tiny_glm_writes_its_scripted_replies(served_model: str) -> None:
    from deployments.tokenizer import load_tokenizer
    from serve_app.args import AppArgs

    bundle = load_tokenizer(AppArgs(model=served_model).model_dir)
    with local_client(served_model, window=640, backend="mlx") as client:
        wrong = {}
        for conversation in CONVERSATIONS:
            tokenize = {"messages": conversation.messages, **conversation.template_kwargs()}
            if "enable_thinking" in tokenize:
                tokenize["chat_template_kwargs"] = {"enable_thinking": tokenize.pop("enable_thinking")}
            rendered = client.post("/tokenize", json=tokenize)
            assert rendered.status_code == 200, rendered.text
            prompt = rendered.json()["tokens"]
            reply = client.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": prompt, "max_tokens": 96, "temperature": 0, "return_token_ids": True},
            ).json()
            if reply["choices"][0]["token_ids"] != bundle.encode(conversation.reply):
                wrong[conversation.name] = bundle.decode(reply["choices"][0]["token_ids"])
        assert not wrong


def test_memory_health_and_metrics_show_the_mlx_figures(served_model: str) -> None:
    with local_client(served_model, backend="mlx") as client:
        assert (
            client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 4}).status_code
            == 200
        )
        health = client.get("/health").json()
        assert health["backend"] == "mlx" and health["memory"]["active"] > 0
        assert set(health["memory"]) == {"active", "cache", "peak"}
        (rank,) = client.get("/memory").json()["replicas"][0]["ranks"]
        figures = rank["mlx"]
        assert figures["active_bytes"] >= rank["weights_bytes"] + rank["kv_pool_bytes"]
        assert figures["footprint_bytes"] > 0 and figures["budget_bytes"] > 0 and figures["mlx_budget_bytes"] > 0
        metrics = client.get("/metrics").text
        line = next(row for row in metrics.splitlines() if row.startswith("tensorfold:process_footprint_bytes{"))
        assert float(line.split()[-1]) > 0


def test_the_keyed_draw_is_the_torch_ranks_own(checkpoints: dict[str, Path]) -> None:
    """The MLX rank draws with sampler.sample_rows on its float32 logits: one seed, position and logits
    give one token on both backends."""
    from deployments.messages.step import SeqDraw, SeqStep, StepPlan
    from deployments.model_rank.mlx_rank.arrays import to_torch
    from deployments.model_rank.mlx_rank.batch import MlxBatch
    from deployments.model_rank.mlx_rank.runner import MlxRunner
    from deployments.model_rank.sampler import sample_rows
    from deployments.model_rank.step_rows import step_rows

    runner = MlxRunner(checkpoints["qwen3"], "float32")
    runner.allocate_kv(8, 16)
    draws = [SeqDraw(temperature=1.5, top_p=0.9, top_k=0, min_p=0.0, seed=seed, reply_position=3) for seed in range(40)]
    plans = [StepPlan("prefill", [SeqStep(list(range(5, 25)), 0, [0, 1], draw=d)]) for d in draws]
    tokens = [runner.execute(plan).draws[0].token for plan in plans]
    logits = to_torch(runner.model.logits(runner.model(MlxBatch.from_rows(step_rows(plans[0], 16), 16))[-1:]))
    assert tokens == [r.token for r in sample_rows(logits.repeat(len(draws), 1), draws)]
    assert len(set(tokens)) > 5  # the seeds do pick different tokens


def _config(**settings) -> EngineConfig:
    return EngineConfig(model="unused", backend="mlx", **settings)


@pytest.mark.parametrize(
    ("settings", "fix"),
    [
        (dict(tensor_parallel_size=2), "--tensor-parallel-size 1"),
        (dict(engine_threads=2), "drop --engine-threads"),
        (dict(device="cuda"), "--device auto"),
    ],
)
def test_mlx_refuses_what_it_cannot_honour(settings: dict, fix: str) -> None:
    with pytest.raises(StartupError, match="backend mlx does not support") as info:
        resolve_backend(_config(**settings))
    assert fix in str(info.value) and "\n" not in str(info.value)
    assert resolve_backend(EngineConfig(model="unused", backend="auto", **settings)) == "torch"


def test_mlx_missing_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("deployments.model_rank.backend.mlx_importable", lambda: False)
    with pytest.raises(StartupError, match="does not import") as info:
        resolve_backend(_config())
    assert MLX_INSTALL in str(info.value)


def test_auto_takes_mlx_on_apple_silicon_only(monkeypatch: pytest.MonkeyPatch) -> None:
    auto = EngineConfig(model="unused")
    assert resolve_backend(auto) == ("mlx" if sys.platform == "darwin" else "torch")
    monkeypatch.setattr("deployments.model_rank.backend.is_apple_silicon", lambda: True)
    assert resolve_backend(auto) == "mlx"
    assert resolve_backend(auto.model_copy(update={"tensor_parallel_size": 2})) == "torch"


def test_the_cli_refuses_before_starting_anything() -> None:
    command = [
        sys.executable,
        "-m",
        "serve_app",
        "serve",
        "builtin:tiny-glm",
        "--backend",
        "mlx",
        "--engine-threads",
        "1",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert (
        done.stderr.strip().splitlines()[-1].startswith("tensorfold serve: backend mlx does not support engine_threads")
    )


def test_bench_engine_measures_mlx_beside_torch(checkpoints: dict[str, Path]) -> None:
    """`tensorfold bench engine --backend mlx` runs both ranks on one checkpoint in one run, a column each."""
    command = [
        sys.executable,
        "-m",
        "serve_app",
        "bench",
        "engine",
        "--checkpoint",
        str(checkpoints["qwen3"]),
        "--backend",
        "mlx",
        "--skip-transformers",
        "--prompt-tokens",
        "24",
        "--decode-tokens",
        "4",
        "--concurrency",
        "2",
        "--threads",
        "1",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.startswith("figure"))
    assert "tensorfold torch" in header and "tensorfold mlx" in header
    decode = next(line for line in lines if line.startswith("decode tok/s, 1 request")).split()
    torch_tps, mlx_tps = float(decode[4]), float(decode[5])
    assert torch_tps > 0 and mlx_tps > 0

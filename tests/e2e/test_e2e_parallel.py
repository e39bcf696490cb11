"""The data-parallel and tensor-parallel configs on Ray Serve: both copies answer; TP2 equals TP1 (tiny-glm,
and a hybrid model whose Mamba2 layers split by heads)."""

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch

from deployments.config import EngineConfig
from deployments.messages.requests import EngineRequest, SamplingParams
from deployments.scheduler.engine.core import Engine
from serve_app.fixtures.checkpoints import build_random_checkpoint
from serve_app.fixtures.tokenizer_builder import build_tokenizer
from tests.conftest import BUILTIN_TINY_GLM, REPO
from tests.support.serve_harness import delete_apps, deploy_apps, load_app_config

pytestmark = pytest.mark.e2e
FACT = {
    "text": "The lighthouse keeper is Brann.",
    "questions": [{"question": "Who keeps the lighthouse?", "answer": "Brann"}],
}
PROMPTS = [
    [{"role": "user", "content": text}]
    for text in ("What is the capital of France?", "Hello!", "Write a short answer.", "Tell me about Tokyo.")
]


def _replies(base_url: str, prompts: list, **request) -> list[tuple[str, str]]:
    """Each reply's (reasoning, answer): a reply cut inside its think block has only reasoning."""

    async def run() -> list[tuple[str, str]]:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=180)
        replies = await asyncio.gather(
            *[client.chat.completions.create(model="tiny-glm", messages=p, **request) for p in prompts]
        )
        await client.close()
        messages = [r.choices[0].message for r in replies]
        return [(getattr(m, "reasoning_content", None) or "", m.content or "") for m in messages]

    return asyncio.run(run())


def test_data_parallel_config_answers_on_both_replicas(serve_url: str, served_model: str) -> None:
    from ray import serve

    deploy_apps([load_app_config("glm-dp2.yaml", "e2e-dp2", "/dp2", model=served_model)])
    try:
        base = f"{serve_url}/dp2"
        replies = _replies(base, PROMPTS * 4, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
        assert len(replies) == 16 and all(reasoning or answer for reasoning, answer in replies)
        statuses = serve.get_deployment_handle("Scheduler", "e2e-dp2").broadcast("info").results(timeout_s=30)
        assert len({s.replica for s in statuses}) == 2
        assert all(s.counters.requests_total > 0 for s in statuses), [s.counters for s in statuses]
        health = httpx.get(f"{base}/health").json()
        assert health["replicas"] == 2 and health["requests_total"] == 16
    finally:
        delete_apps(["e2e-dp2"])


def _refuse_cuda(*args, **kwargs) -> None:
    raise AssertionError("the Scheduler's process called torch.cuda")


def test_a_tensor_parallel_engine_never_touches_cuda(ray_cluster: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """At TP2 the engine's ranks hold the devices: the engine plans its pool from their memory reports.
    Importing its core initialises no CUDA, and starting and stepping it calls nothing of torch.cuda in its
    own process (where, on a node without GPUs, torch sees none)."""
    importing = (
        "import torch\n"
        "def refuse(*args, **kwargs):\n    raise SystemExit('importing the engine initialised CUDA')\n"
        "torch.cuda._lazy_init = refuse\n"
        "import deployments.scheduler.engine.core, deployments.scheduler.deployment\n"
    )
    subprocess.run([sys.executable, "-c", importing], cwd=REPO, check=True, timeout=300)
    for name in ("_lazy_init", "is_available", "device_count", "mem_get_info", "current_device"):
        monkeypatch.setattr(torch.cuda, name, _refuse_cuda)  # not even asked whether there is a GPU
    config = EngineConfig(
        model=str(BUILTIN_TINY_GLM), tensor_parallel_size=2, parallel=2, kv_cache_gib=0.02, engine_threads=1
    )
    engine = Engine(config)
    try:
        greedy = SamplingParams(temperature=0.0, ignore_eos=True)
        reply = engine.generate([EngineRequest("tp2", [5, 9, 14, 3], sampling=greedy, max_tokens=4)])
        assert len(reply["tp2"].token_ids) == 4
        assert engine.memory().ranks[1].device is None  # the ranks' devices are theirs to read
    finally:
        engine.shutdown()


def test_tensor_parallel_2_replies_equal_tensor_parallel_1(serve_url: str, served_model: str, tmp_path: Path) -> None:
    slide = {"slide": True, "slide_capacity": 4}
    deploy_apps(
        [
            load_app_config("glm.yaml", "e2e-tp1", "/tp1", model=served_model, slide_dir=str(tmp_path / "tp1"), **slide),
            # Fixed draft lengths on TP2: the drafts asserted below do not depend on measured step times.
            load_app_config(
                "glm-tp2.yaml", "e2e-tp2", "/tp2", model=served_model, draft_policy="fixed",
                slide_dir=str(tmp_path / "tp2"), **slide,
            ),
        ]
    )  # fmt: skip
    try:
        request = dict(max_tokens=24, temperature=0)
        tp1 = _replies(f"{serve_url}/tp1", PROMPTS, **request)
        tp2 = _replies(f"{serve_url}/tp2", PROMPTS, **request)
        assert tp2 == tp1
        seeded = dict(max_tokens=24, temperature=0.8, seed=7)
        assert _replies(f"{serve_url}/tp2", PROMPTS, **seeded) == _replies(f"{serve_url}/tp1", PROMPTS, **seeded)
        # Both ranks verify the same MTP drafts: drafted TP2 replies equal the serial reference's.
        assert _replies(f"{serve_url}/tp2", PROMPTS, **request, extra_body={"draft": False}) == tp1
        block = httpx.post(
            f"{serve_url}/tp2/v1/chat/completions", timeout=120, json={"messages": PROMPTS[0], **request}
        ).json()["tensorfold"]
        assert block["drafts"] == "mtp" and block["drafted"] > 0
        # Living weights at TP2: both ranks capture and train alike and hold the staged versions; the fact
        # is answered as at TP1, and every other reply stays what it was.
        for base in (f"{serve_url}/tp1", f"{serve_url}/tp2"):
            learned = httpx.post(f"{base}/v1/slide/learn", json={"facts": [FACT], "stream": False}, timeout=300)
            assert learned.status_code == 200 and learned.json()["events"][-1]["type"] == "learned", learned.text
        asked = [[{"role": "user", "content": FACT["questions"][0]["question"]}]]
        thinking_off = {**request, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
        assert _replies(f"{serve_url}/tp2", asked, **thinking_off) == _replies(
            f"{serve_url}/tp1", asked, **thinking_off
        )
        assert _replies(f"{serve_url}/tp2", asked, **thinking_off) == [("", "Brann")]
        assert _replies(f"{serve_url}/tp2", PROMPTS, **request) == tp1
    finally:
        delete_apps(["e2e-tp1", "e2e-tp2"])


def _completions(base_url: str, prompts: list[list[int]], **request) -> list[dict]:
    """Each token-id prompt's reply (choices[0] with its token ids, plus usage and the runtime block), sent
    together so that the engine batches them."""

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=base_url, timeout=180) as client:
            bodies = [{"prompt": p, "return_token_ids": True, **request} for p in prompts]
            replies = await asyncio.gather(*[client.post("/v1/completions", json=body) for body in bodies])
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        return [r.json() for r in replies]

    return asyncio.run(run())


def test_hybrid_tensor_parallel_2_replies_equal_tensor_parallel_1(serve_url: str, tmp_path: Path) -> None:
    """Nemotron-H (Mamba2 split by heads, latent MoE, MTP drafts) at TP2 answers as at TP1: greedy and seeded,
    drafted and serial, and a second turn that resumes from the first turn's state snapshot."""
    model = build_random_checkpoint("nemotron_h", tmp_path / "nemotron_h")
    build_tokenizer(model, family="qwen")
    args = dict(model=str(model), dtype="float32", draft_policy="fixed")
    deploy_apps(
        [
            load_app_config("glm.yaml", "e2e-hybrid-tp1", "/hybrid-tp1", **args),
            load_app_config("glm-tp2.yaml", "e2e-hybrid-tp2", "/hybrid-tp2", **args),
        ]
    )
    try:
        gen = torch.Generator().manual_seed(5)
        prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (40, 23, 57)]
        for request in (
            dict(max_tokens=24, temperature=0, ignore_eos=True),
            dict(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True),
            dict(max_tokens=24, temperature=0, ignore_eos=True, draft=False),
        ):
            tp1 = _completions(f"{serve_url}/hybrid-tp1", prompts, **request)
            tp2 = _completions(f"{serve_url}/hybrid-tp2", prompts, **request)
            assert [r["choices"][0]["token_ids"] for r in tp2] == [r["choices"][0]["token_ids"] for r in tp1]
        drafted = _completions(f"{serve_url}/hybrid-tp2", prompts[:1], max_tokens=24, temperature=0, ignore_eos=True)
        assert drafted[0]["tensorfold"]["drafts"] == "mtp" and drafted[0]["tensorfold"]["drafted"] > 0
        # The next turn: the first prompt, its reply and more tokens resume at a snapshot on every rank.
        turn = prompts[0] + tp1[0]["choices"][0]["token_ids"] + prompts[1][:9]
        second = [
            _completions(f"{serve_url}/{prefix}", [turn], max_tokens=16, temperature=0, ignore_eos=True)[0]
            for prefix in ("hybrid-tp1", "hybrid-tp2")
        ]
        assert second[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
        assert second[1]["choices"][0]["token_ids"] == second[0]["choices"][0]["token_ids"]
    finally:
        delete_apps(["e2e-hybrid-tp1", "e2e-hybrid-tp2"])

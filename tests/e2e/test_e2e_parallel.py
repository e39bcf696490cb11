"""The data-parallel and tensor-parallel configs on Ray Serve: both copies answer; TP2 equals TP1."""

import asyncio

import httpx
import openai
import pytest

from tests.support.serve_harness import delete_apps, deploy_apps, load_app_config

pytestmark = pytest.mark.e2e
PROMPTS = [
    [{"role": "user", "content": text}]
    for text in ("What is the capital of France?", "Hello!", "Write a short answer.", "Tell me about Tokyo.")
]


def _replies(base_url: str, prompts: list, **request) -> list[tuple[str, str]]:
    """Each reply's (reasoning, answer): a reply cut inside its think block has only reasoning."""

    async def run() -> list[tuple[str, str]]:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=180)
        replies = await asyncio.gather(
            *[client.chat.completions.create(model="m", messages=p, **request) for p in prompts]
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


def test_tensor_parallel_2_replies_equal_tensor_parallel_1(serve_url: str, served_model: str) -> None:
    deploy_apps(
        [
            load_app_config("glm.yaml", "e2e-tp1", "/tp1", model=served_model),
            # Fixed draft lengths on TP2: the drafts asserted below do not depend on measured step times.
            load_app_config("glm-tp2.yaml", "e2e-tp2", "/tp2", model=served_model, draft_policy="fixed"),
        ]
    )
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
    finally:
        delete_apps(["e2e-tp1", "e2e-tp2"])

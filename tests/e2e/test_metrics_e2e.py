"""The dp2 config on Ray Serve: /metrics and /memory cover both Scheduler replicas, and the readings reach
Ray's own metrics export (what the Ray dashboard and Ray's Prometheus endpoint show)."""

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.serve_harness import delete_apps, deploy_apps, load_app_config

pytestmark = pytest.mark.e2e
QUESTIONS = ["What is the capital of France?", "Hello!", "Write a short answer.", "Tell me about Tokyo."]
RAY_EXPORT_WAIT_S = 45.0


def _usages(base: str, count: int) -> list[dict]:
    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=base, timeout=180) as client:
            bodies = [
                {
                    "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                    "max_tokens": 8,
                    "ignore_eos": True,
                }
                for i in range(count)
            ]
            replies = await asyncio.gather(*[client.post("/v1/chat/completions", json=b) for b in bodies])
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        return [r.json()["usage"] for r in replies]

    return asyncio.run(run())


def _samples(text: str) -> dict[tuple[str, str | None], float]:
    """(name, the key/pool/le label) -> value."""
    return {
        (s.name, s.labels.get("key", s.labels.get("pool", s.labels.get("le")))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _ray_export(name: str) -> float | None:
    """The summed value of `name` in this node's Ray metrics export, or None when it is not there yet."""
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    values = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and s.labels.get("application") == "e2e-metrics"
    ]
    return sum(values) if values else None


def test_dp2_metrics_aggregate_both_replicas(serve_url: str, served_model: str) -> None:
    from ray import serve

    deploy_apps([load_app_config("glm-dp2.yaml", "e2e-metrics", "/metrics-dp2", model=served_model)])
    try:
        base = f"{serve_url}/metrics-dp2"
        usages = _usages(base, 12)
        statuses = serve.get_deployment_handle("Scheduler", "e2e-metrics").broadcast("info").results(timeout_s=30)
        scraped = _samples(httpx.get(f"{base}/metrics").text)
        assert scraped[("tensorfold:requests_total", "none")] == 12
        assert scraped[("tensorfold:prompt_tokens_total", None)] == sum(u["prompt_tokens"] for u in usages)
        assert scraped[("tensorfold:generation_tokens_total", None)] == sum(u["completion_tokens"] for u in usages)
        assert scraped[("tensorfold:request_latency_seconds_bucket", "+Inf")] == 12
        assert scraped[("tensorfold:e2e_request_latency_seconds_sum", None)] == pytest.approx(
            scraped[("tensorfold:request_latency_seconds_sum", None)]
        )
        pools = {pool for name, pool in scraped if name == "tensorfold:kv_cache_usage_ratio"}
        assert pools == {s.replica for s in statuses} and len(pools) == 2
        assert sum(s.counters.requests_total for s in statuses) == 12
        memory = httpx.get(f"{base}/v1/memory").json()
        assert {r["replica"] for r in memory["replicas"]} == pools
        assert httpx.get(f"{base}/dashboard").status_code == 404  # the flag is off in this config

        deadline = time.monotonic() + RAY_EXPORT_WAIT_S  # Ray reports metrics every few seconds
        exported = None
        while time.monotonic() < deadline and exported != 12:
            time.sleep(2)
            exported = _ray_export("ray_tensorfold_requests_total")
        assert exported == 12, f"Ray's metrics export shows {exported} finished requests"
    finally:
        delete_apps(["e2e-metrics"])

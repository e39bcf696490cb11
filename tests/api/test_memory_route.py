"""GET /memory and /v1/memory over the real routes and engine in-process; /health?reset_peak=1."""

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from deployments.chat_format.rendering import PromptRenderer
from deployments.config import EngineConfig
from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from deployments.scheduler.memory_report import process_rss_bytes
from serve_app.local_backend import LocalBackend
from tests.support.bodies import LONG


@pytest.fixture(scope="module")
def client(served_model: str) -> Iterator[TestClient]:
    from deployments.scheduler.engine.core import Engine
    from deployments.scheduler.transports.thread import EngineLoop
    from serve_app.args import AppArgs

    model_dir = AppArgs(model=served_model).model_dir
    loop = EngineLoop(Engine(EngineConfig(model=str(model_dir), context=192, kv_cache_gib=0.05, device="cpu")))
    loop.start()
    backend = LocalBackend(PromptRenderer.from_checkpoint(model_dir), loop)
    with TestClient(build_api(backend, IngressSettings(served_name="tiny", model_ids=["tiny"]))) as test_client:
        yield test_client
    loop.shutdown()


def test_memory_snapshot_per_replica_and_rank(client: TestClient) -> None:
    before = client.get("/memory").json()
    reply = client.post("/v1/chat/completions", json={"messages": LONG, "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200
    body = client.get("/v1/memory").json()
    assert body["object"] == "memory" and body["model"] == "tiny"
    [replica] = body["replicas"]
    [rank] = replica["ranks"]
    assert replica["replica"] == "local" and rank["rank"] == 0
    assert rank["weights_bytes"] > 0
    assert rank["kv_pool_bytes"] == replica["kv_bytes_per_block"] * replica["kv_blocks_total"] > 0
    assert 0 <= replica["kv_blocks_used"] <= replica["kv_blocks_total"]
    # The finished prompt's full blocks stay named for reuse: the prompt cache grew.
    assert replica["prompt_cache_blocks"] > before["replicas"][0]["prompt_cache_blocks"]
    assert replica["process_rss_bytes"] > 0 and rank["process_rss_bytes"] > 0
    assert abs(replica["process_rss_bytes"] - process_rss_bytes()) < 1 << 30  # this very process
    assert rank["device"] is None  # CPU: no device figures rather than zeros
    assert body["totals"]["weights_bytes"] == rank["weights_bytes"]
    assert body["totals"]["prompt_cache_bytes"] == replica["prompt_cache_blocks"] * replica["kv_bytes_per_block"]


def test_health_reset_peak_answers_and_keeps_its_fields(client: TestClient) -> None:
    plain = client.get("/health").json()
    reset = client.get("/health", params={"reset_peak": "1"})
    assert reset.status_code == 200
    assert list(reset.json()) == list(plain)
    assert reset.json()["memory"] == {}  # CPU: the Metal-like empty object docs/api.md shows, never zeros

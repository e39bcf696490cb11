"""Drafted and `draft: false` replies on every generation route, and what they report (runtime block,
finish log, /health), through Ingress over an in-process engine drafting with tiny-glm's MTP layer.
(tests/api/test_draft_field.py checks the field itself over a recording backend.)"""

import logging

import pytest
from fastapi.testclient import TestClient

from deployments.chat_format.rendering import PromptRenderer
from deployments.config import EngineConfig
from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from serve_app.local_backend import LocalBackend

STORY = [{"role": "user", "content": "Tell me a story."}]
ROUTES = {  # path -> a body that generates, before `draft` is added
    "/v1/chat/completions": {"messages": STORY, "max_tokens": 40, "temperature": 0},
    "/v1/completions": {"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0},
    "/v1/messages": {"messages": STORY, "max_tokens": 40, "temperature": 0},
    "/v1/responses": {"input": "Tell me a story.", "max_output_tokens": 40, "temperature": 0},
}


@pytest.fixture(scope="module")
def client(served_model: str) -> TestClient:
    from deployments.scheduler.engine.core import Engine
    from deployments.scheduler.transports.thread import EngineLoop
    from serve_app.args import AppArgs

    model_dir = AppArgs(model=served_model).model_dir
    engine = Engine(
        EngineConfig(model=str(model_dir), context=512, kv_cache_gib=0.05, device="cpu", draft_policy="fixed")
    )
    loop = EngineLoop(engine)
    loop.start()
    backend = LocalBackend(PromptRenderer.from_checkpoint(model_dir), loop)
    with TestClient(build_api(backend, IngressSettings(served_name="tiny", model_ids=["tiny"]))) as test_client:
        yield test_client
    loop.shutdown()


@pytest.mark.parametrize("path", list(ROUTES))
def test_drafted_and_serial_replies_are_equal_and_report_their_drafts(
    client: TestClient, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="tensorfold.requests"):
        drafted = client.post(path, json={**ROUTES[path], "draft": True}).json()
        serial = client.post(path, json={**ROUTES[path], "draft": False}).json()
        default = client.post(path, json=ROUTES[path]).json()
    on, off = drafted["tensorfold"], serial["tensorfold"]
    assert on["token_sha"] == off["token_sha"] == default["tensorfold"]["token_sha"]
    assert on["drafts"] == "mtp" and on["drafted"] >= on["accepted"] > 0
    assert on["acceptance_rate"] == round(on["accepted"] / on["drafted"], 4) and on["tokens_per_round"] > 1
    assert off["drafts"] == "off" and off["drafted"] == off["accepted"] == 0 and off["tokens_per_round"] == 1.0
    assert on["rounds"] < off["rounds"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("finished")]
    assert f"drafts={on['accepted']}/{on['drafted']}" in lines[0] and "drafts=-" in lines[1]


def test_health_counts_drafted_and_kept_tokens(client: TestClient) -> None:
    before = client.get("/health").json()
    reply = client.post("/v1/chat/completions", json=ROUTES["/v1/chat/completions"]).json()["tensorfold"]
    after = client.get("/health").json()
    assert after["drafts"] == "mtp" and after["draft_tokens"] == 3
    assert after["drafted_total"] - before["drafted_total"] == reply["drafted"]
    assert after["accepted_total"] - before["accepted_total"] == reply["accepted"]

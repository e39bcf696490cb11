"""Property-based fuzzing with schemathesis against the app's own /openapi.json, in-process over ASGI.

Valid and invalid bodies, queries and headers from each operation's schema, a bounded number per route:
no 5xx, every reply quick, and afterwards a reference request replies as it did before and the engine
holds no request. (The graph itself is smoke-tested in tests/e2e/test_auth_e2e.py.)
"""

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from deployments.ingress.http.keys import auth_settings
from serve_app.local_backend import LocalBackend
from tests.support.local_app import local_backend

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES_PER_ROUTE = 8  # 2 modes x 11 operations: about 20 s on 2 cores; raise locally for a deeper run
REPLY_LIMIT_S = 10.0  # a generation at this small window takes well under a second
REFERENCE = {
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 6,
    "temperature": 0.7,
    "seed": 3,
}


@pytest.fixture(scope="module")
def fuzz_backend(served_model: str) -> Iterator[LocalBackend]:
    with local_backend(served_model, window=64) as backend:  # a small window bounds every generation
        yield backend


@pytest.fixture(scope="module")
def fuzz_app(fuzz_backend: LocalBackend) -> FastAPI:
    auth = auth_settings([KEY], None, False, None)
    return build_api(fuzz_backend, IngressSettings(served_name="tiny", model_ids=["tiny"], auth=auth))


def _reference(app: FastAPI) -> dict[str, Any]:
    from fastapi.testclient import TestClient

    return TestClient(app).post("/v1/chat/completions", json=REFERENCE, headers=AUTH).json()


@pytest.fixture(scope="module")
def reference_before(fuzz_app: FastAPI) -> dict[str, Any]:
    return _reference(fuzz_app)


def _fuzz_operation(operation: Any, mode: GenerationMode) -> None:
    """One route, one mode: a bounded Hypothesis run of schemathesis cases through the ASGI app."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES_PER_ROUTE,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    def check(case: Any) -> None:
        started = time.monotonic()
        response = case.call(headers=AUTH)
        elapsed = time.monotonic() - started
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])
        assert elapsed < REPLY_LIMIT_S, (case.method, case.path, elapsed)

    check()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_route_fails_or_hangs_on_generated_input(
    fuzz_app: FastAPI, reference_before: dict[str, Any], mode: GenerationMode
) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app, headers=AUTH)  # the schema needs a key too
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    for operation in operations:
        _fuzz_operation(operation, mode)


def test_after_fuzzing_the_engine_is_idle_and_replies_the_same(
    fuzz_app: FastAPI, fuzz_backend: LocalBackend, reference_before: dict[str, Any]
) -> None:
    (status,) = asyncio.run(fuzz_backend.replicas())
    assert status.running == 0 and status.waiting == 0
    after = _reference(fuzz_app)
    assert after["choices"] == reference_before["choices"]
    assert after["tensorfold"]["token_sha"] == reference_before["tensorfold"]["token_sha"]

"""Property-based fuzzing with schemathesis against the app's own /openapi.json, in-process over ASGI.

Valid and invalid bodies, queries and headers from each operation's schema, a bounded number per operation
(derandomized and without the project's own literals, so every run sends the same cases): no 5xx, every
reply quick and inside what the document says of it (a documented status, content type and body schema,
each event of a stream included), and afterwards a reference request replies as it did before and the
engine holds no request. (The graph itself
is smoke-tested in tests/e2e/test_auth_e2e.py.)
"""

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis.internal.conjecture import providers
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from deployments.ingress.http.keys import auth_settings
from serve_app.local_backend import LocalBackend
from tests.support.local_app import local_backend

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES_PER_ROUTE = 8  # 2 modes x 20 operations: about 30 s on 2 cores; raise locally for a deeper run
# No 5xx, and nothing outside the operation's documented responses; a case the document calls invalid is refused.
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
MODE_CHECKS = {GenerationMode.POSITIVE: CHECKS, GenerationMode.NEGATIVE: [*CHECKS, negative_data_rejection]}
REPLY_LIMIT_S = 10.0  # a generation at this small window takes well under a second
REFERENCE = {
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 6,
    "temperature": 0.7,
    "seed": 3,
}


@pytest.fixture(scope="module", autouse=True)
def no_project_literals() -> Iterator[None]:
    """Hypothesis also draws the string and number literals of the project's imported modules, and which
    those are depends on what ran before in the process (and on threads importing lazily): the cases would
    too. The fuzz draws from Hypothesis' own pool alone, the same cases in any order and process."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(providers, "_get_local_constants", providers.Constants)
        patch.setattr(providers, "CONSTANTS_CACHE", type(providers.CONSTANTS_CACHE)(1024))
        yield


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
        case.validate_response(response, checks=MODE_CHECKS[mode])
        assert elapsed < REPLY_LIMIT_S, (case.method, case.path, elapsed)

    check()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation_answers_generated_input_quickly_and_as_documented(
    fuzz_app: FastAPI, reference_before: dict[str, Any], mode: GenerationMode
) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app, headers=AUTH)  # the schema needs a key too
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20
    for operation in operations:
        if mode == GenerationMode.POSITIVE or _has_input(operation):
            _fuzz_operation(operation, mode)


def _has_input(operation: Any) -> bool:
    """Whether an operation takes anything a negative case could break (/health takes nothing)."""
    parameters = (operation.path_parameters, operation.headers, operation.query)
    return bool(operation.definition.raw.get("requestBody")) or any(len(p) for p in parameters)


STREAMED = {  # a body each streaming operation answers, whole and as events
    "/v1/chat/completions": {"messages": REFERENCE["messages"], "max_tokens": 4},
    "/v1/completions": {"prompt": "The capital of France is", "max_tokens": 4, "logprobs": 1},
    "/v1/messages": {"messages": REFERENCE["messages"], "max_tokens": 4},
    "/v1/responses": {"input": "What is the capital of France?", "max_output_tokens": 4},
}


@pytest.mark.parametrize("path", list(STREAMED))
def test_whole_and_streamed_replies_are_what_the_document_says(fuzz_app: FastAPI, path: str) -> None:
    """Generated cases seldom ask for a stream; these do, so every event is checked against the document."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app, headers=AUTH)
    operation = schema[path]["POST"]
    for stream in (False, True):
        case = operation.Case(body={**STREAMED[path], "stream": stream}, media_type="application/json")
        response = case.call(headers=AUTH)
        assert response.status_code == 200, response.text[:300]
        assert response.headers["content-type"][0].startswith("text/event-stream" if stream else "application/json")
        case.validate_response(response, checks=CHECKS)


def test_after_fuzzing_the_engine_is_idle_and_replies_the_same(
    fuzz_app: FastAPI, fuzz_backend: LocalBackend, reference_before: dict[str, Any]
) -> None:
    (status,) = asyncio.run(fuzz_backend.replicas())
    assert status.running == 0 and status.waiting == 0
    after = _reference(fuzz_app)
    assert after["choices"] == reference_before["choices"]
    assert after["tensorfold"]["token_sha"] == reference_before["tensorfold"]["token_sha"]

"""What every body route checks before work: the model a body names, bodies up to the size limit, prompts
whose size proves they fill the window, and the error statuses /openapi.json documents for each route.

In-process over the real routes, renderer and engine (no Ray); the graph's gRPC hop for large bodies is
tests/e2e/test_large_bodies_e2e.py.
"""

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from deployments.messages.window import min_tokens
from deployments.tokenizer import load_tokenizer
from serve_app.local_backend import LocalBackend
from tests.support.bodies import USER, user
from tests.support.local_app import local_backend

JSON = {"content-type": "application/json"}
CITY = {"id": "city", "type": "choice", "question": "Which city?", "options": [{"name": "Paris"}, {"name": "Rome"}]}
# One body per route that reads one: each answers 200 as it stands.
ROUTE_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": USER, "max_tokens": 2},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2},
    "/v1/responses": {"input": "Hello", "max_output_tokens": 2},
    "/v1/messages": {"messages": USER, "max_tokens": 2},
    "/v1/messages/count_tokens": {"messages": USER},
    "/tokenize": {"prompt": "Hello"},
    "/v1/tokenize": {"messages": USER},
    "/detokenize": {"tokens": [1, 2]},
    "/v1/decisions": {"input": "The capital of France is Paris.", "questions": [CITY]},
}


@pytest.fixture(scope="module")
def backend(served_model: str) -> Iterator[LocalBackend]:
    with local_backend(served_model, window=400) as value:  # room for a decision's prompt
        yield value


@pytest.fixture(scope="module")
def client(backend: LocalBackend) -> Iterator[TestClient]:
    app = build_api(backend, IngressSettings(served_name="tiny", model_ids=["tiny", "glm"]))
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def _error_code(path: str, reply: httpx.Response) -> str | None:
    """OpenAI's `code`, or Anthropic's error `type` on the Messages routes."""
    body = reply.json()
    return body["error"]["type"] if path.startswith("/v1/messages") else body["error"]["code"]


@pytest.mark.parametrize("path", list(ROUTE_BODIES))
def test_an_unknown_model_is_404_and_the_served_ids_pass(client: TestClient, path: str) -> None:
    for model in ("tiny", "glm", None):  # the served name, an alias, and none (the served model)
        body = ROUTE_BODIES[path] if model is None else {**ROUTE_BODIES[path], "model": model}
        reply = client.post(path, json=body)
        assert reply.status_code == 200, (path, model, reply.text[:300])
    reply = client.post(path, json={**ROUTE_BODIES[path], "model": "gpt-4o"})
    assert reply.status_code == 404, (path, reply.text[:300])
    assert _error_code(path, reply) == ("not_found_error" if path.startswith("/v1/messages") else "model_not_found")
    assert "gpt-4o" in reply.json()["error"]["message"]
    if not path.startswith("/v1/messages"):
        assert reply.json()["error"]["param"] == "model" and reply.json()["error"]["type"] == "invalid_request_error"


def test_a_non_string_model_is_a_400_naming_it(client: TestClient) -> None:
    reply = client.post("/v1/chat/completions", json={"messages": USER, "model": 5})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "model", reply.text


def _huge_chat(megabytes: float) -> dict[str, Any]:
    return {"messages": user("Paris is lovely. " * int(megabytes * (1 << 20) / 17)), "max_tokens": 2}


@pytest.mark.parametrize("megabytes", [5, 15])
def test_large_bodies_past_the_window_are_refused_by_their_size(client: TestClient, megabytes: int) -> None:
    """Under the 16 MiB limit, every route reading a prompt answers as it would a short one past the
    window; the message's lower bound shows the prompt was never tokenised (which takes seconds)."""
    text = "Paris is lovely. " * int(megabytes * (1 << 20) / 17)
    bodies = {
        "/v1/chat/completions": ("messages", {"messages": user(text)}),
        "/v1/completions": ("prompt", {"prompt": text}),
        "/v1/responses": ("input", {"input": text}),
        "/v1/messages": ("messages", {"messages": user(text), "max_tokens": 4}),
        "/v1/messages/count_tokens": ("messages", {"messages": user(text)}),
        "/tokenize": ("prompt", {"prompt": text}),
        "/v1/tokenize": ("messages", {"messages": user(text)}),
        "/v1/decisions": ("questions[0]", {"input": text, "questions": [CITY]}),
    }
    for path, (param, body) in bodies.items():
        started = time.monotonic()
        reply = client.post(path, content=json.dumps(body), headers=JSON)
        assert reply.status_code == 400, (path, reply.text[:300])
        error = reply.json()["error"]
        assert "at least" in error["message"], (path, error)
        if path.startswith("/v1/messages"):
            assert error["type"] == "invalid_request_error"
        else:
            assert (error["code"], error["param"]) == ("context_length_exceeded", param), (path, error)
        assert time.monotonic() - started < 5.0, path  # tokenising 15 MB takes ~25 s on this machine


def test_small_chats_are_not_held_up_by_large_tokenisations(backend: LocalBackend) -> None:
    """8 large prompts tokenised (250 kB each, ~0.4 s of CPU: what a wide window lets through) and 8 3 MB
    chat bodies (refused by their size) arrive with 8 small chats: each small chat finishes before the large
    tokenisations are all done (on the event loop, or in one shared pool, it would wait for them), and its
    reply is the one it gets alone."""
    app = build_api(backend, IngressSettings(served_name="tiny", model_ids=["tiny"]))
    small = {"messages": USER, "max_tokens": 2, "temperature": 0}
    huge = json.dumps({"messages": user("Paris is lovely. " * 185_000), "max_tokens": 2})
    wide = "Paris is lovely. " * 15_000

    async def run() -> tuple[list[float], float, list[dict[str, Any]], dict[str, Any]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://local", timeout=120) as http:
            alone = (await http.post("/v1/chat/completions", json=small)).json()
            started = time.monotonic()
            done: list[float] = []

            async def chat() -> dict[str, Any]:
                reply = await http.post("/v1/chat/completions", json=small)
                done.append(time.monotonic() - started)
                return reply.json()

            async def refused() -> int:
                return (await http.post("/v1/chat/completions", content=huge, headers=JSON)).status_code

            large = [asyncio.create_task(backend.tokenize(wide, False)) for _ in range(8)]  # as /tokenize asks
            huge_tasks = [asyncio.create_task(refused()) for _ in range(8)]
            await asyncio.sleep(0.05)  # the large work is under way first
            chats = await asyncio.gather(*[chat() for _ in range(8)])
            counts = [len(ids) for ids in await asyncio.gather(*large)]
            large_done = time.monotonic() - started
            assert await asyncio.gather(*huge_tasks) == [400] * 8
            assert len(set(counts)) == 1 and counts[0] > 50_000
            return done, large_done, chats, alone

    done, large_done, chats, alone = asyncio.run(run())
    assert max(done) < large_done, (done, large_done)
    assert all(c["choices"] == alone["choices"] for c in chats)
    print(f"\nsmall chats under load: max {max(done):.3f} s; large tokenisations done at {large_done:.2f} s")


def test_openapi_documents_each_routes_error_statuses(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    assert {"ErrorResponse", "AnthropicErrorResponse"} <= set(schemas)
    for path, operations in spec["paths"].items():
        envelope = "AnthropicErrorResponse" if path.startswith("/v1/messages") else "ErrorResponse"
        for method, operation in operations.items():
            expected = {"405", "500", "503"} | ({"400", "404", "413", "415"} if "requestBody" in operation else set())
            assert expected <= set(operation["responses"]), (method, path, list(operation["responses"]))
            for status in expected - ({"503"} if path in ("/health", "/") else set()):  # its own status body
                ref = operation["responses"][status]["content"]["application/json"]["schema"]["$ref"]
                assert ref == f"#/components/schemas/{envelope}", (path, status)
            assert "Allow" in operation["responses"]["405"]["headers"]
    assert schemas["ChatCompletionRequest"]["properties"]["model"]["anyOf"][0] == {"enum": ["tiny", "glm"]}


@pytest.mark.parametrize("path", list(ROUTE_BODIES))
def test_the_documented_errors_are_what_the_route_answers(client: TestClient, path: str) -> None:
    """404 (unknown model), 415 (not JSON) and 405 (wrong method, with Allow) in the documented envelope."""
    operation = client.get("/openapi.json").json()["paths"][path]["post"]
    envelope = "AnthropicErrorResponse" if path.startswith("/v1/messages") else "ErrorResponse"
    required = set(client.get("/openapi.json").json()["components"]["schemas"][envelope]["required"])
    answers = [
        client.post(path, json={**ROUTE_BODIES[path], "model": "nope"}),
        client.post(path, content=b"{}", headers={"content-type": "text/plain"}),
        client.get(path),
    ]
    for reply in answers:
        assert str(reply.status_code) in operation["responses"], (path, reply.status_code)
        assert required <= set(reply.json()), (path, reply.json())
    assert [a.status_code for a in answers] == [404, 415, 405]
    assert "POST" in answers[2].headers["allow"]


def _bound_holds(bundle: Any) -> None:
    texts = [
        "Paris is lovely. " * 200,
        " " * 3000 + "\n" * 500 + "\t" * 300,
        "日本語のテキスト、そして絵文字 🎉🎉🎉 " * 50,
        "def f(x):\n        return x  # comment\n" * 100,
        "".join(chr(c) for c in range(32, 3000)),
        "<|user|>hello<|assistant|>" * 40,
    ]
    for text in texts:
        assert len(bundle.encode(text)) >= min_tokens(text, bundle.max_token_bytes), text[:40]


def test_the_size_bound_never_exceeds_the_real_count(served_model: str) -> None:
    """The refusal is a proof: no text encodes to fewer tokens than its bytes over `max_token_bytes`."""
    from serve_app.args import AppArgs
    from serve_app.fixtures.tokenizer_builder import qwen3_tokenizer_dir

    _bound_holds(load_tokenizer(AppArgs(model=served_model).model_dir))
    qwen = qwen3_tokenizer_dir()
    if qwen is not None:  # the real Qwen3 vocabulary, where the package is installed (the test extras)
        _bound_holds(load_tokenizer(qwen))

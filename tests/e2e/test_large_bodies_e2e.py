"""Bodies up to the 16 MiB limit through the real graph: each travels Ingress -> Renderer over Serve's gRPC
path (4 MiB by default, which answered 500 with gRPC's internals), and is answered as on the in-process
app (tests/api/test_request_limits.py): past the window, a 400 in the route's format; an unknown model, 404.
"""

import json

import httpx
import pytest

pytestmark = pytest.mark.e2e
JSON = {"content-type": "application/json"}


def _bodies(text: str) -> dict[str, tuple[str, dict]]:
    """Each body-reading route, the field its window refusal names, and a body carrying `text`."""
    user = [{"role": "user", "content": text}]
    return {
        "/v1/chat/completions": ("messages", {"messages": user}),
        "/v1/completions": ("prompt", {"prompt": text}),
        "/v1/responses": ("input", {"input": text}),
        "/v1/messages": ("messages", {"messages": user, "max_tokens": 4}),
        "/v1/messages/count_tokens": ("messages", {"messages": user}),
        "/tokenize": ("prompt", {"prompt": text}),
        "/v1/tokenize": ("messages", {"messages": user}),
    }


@pytest.mark.parametrize("megabytes", [5, 15])
def test_bodies_past_4_mib_are_answered_not_failed(glm_base_url: str, megabytes: int) -> None:
    text = "Paris is lovely. " * int(megabytes * (1 << 20) / 17)
    with httpx.Client(base_url=glm_base_url, timeout=120) as client:
        for path, (param, body) in _bodies(text).items():
            reply = client.post(path, content=json.dumps(body), headers=JSON)
            assert reply.status_code == 400, (path, reply.status_code, reply.text[:300])
            error = reply.json()["error"]
            if path.startswith("/v1/messages"):
                assert error["type"] == "invalid_request_error" and "context length" in error["message"]
            else:
                assert (error["code"], error["param"]) == ("context_length_exceeded", param), (path, error)
        tokens = client.post("/detokenize", json={"tokens": [5] * (megabytes * (1 << 20) // 3)})
        assert tokens.status_code == 200 and tokens.json()["prompt"], tokens.text[:300]


def test_an_unknown_model_is_404_through_the_graph(glm_base_url: str) -> None:
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    reply = httpx.post(f"{glm_base_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found", reply.text
    alias = httpx.post(f"{glm_base_url}/v1/chat/completions", json={**body, "model": "glm"}, timeout=60)
    assert alias.status_code == 200, alias.text

"""The imprint routes and a conversation resumed from the disk store, over the real routes in-process."""

import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from deployments.ingress.ops.serving import OFF_MESSAGE
from deployments.messages.store import PieceWrite, StoreCall
from deployments.prompt_store.failures import StoreFailedError
from deployments.prompt_store.links import UNANSWERED, LocalStoreLink
from deployments.scheduler.engine.disk_states import DELETE_REFUSED
from tests.support.local_app import local_backend, local_client

WINDOW = 1024
REPO = Path(__file__).resolve().parents[2]
OPENING = "Please keep these notes. " + " ".join(f"Note {i}: the harbour opens at dawn." for i in range(20))


def _client(served_model: str, learn_dir: Path, store: type | None = None):
    class Served:
        def __enter__(self) -> TestClient:
            self._backend = local_backend(served_model, WINDOW, str(learn_dir), store=store)
            backend = self._backend.__enter__()
            settings = IngressSettings(served_name="tiny", model_ids=["tiny"], learn_conversations=True, dashboard=True)
            self._client = TestClient(build_api(backend, settings))
            return self._client.__enter__()

        def __exit__(self, *exc: object) -> None:
            self._client.__exit__(*exc)
            self._backend.__exit__(*exc)

    return Served()


def _body(messages: list[dict]) -> dict:
    return {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 10,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False},
    }


def _wait_on_disk(client: TestClient, body: dict) -> dict:
    """The engine writes while idle: wait until the store holds the conversation."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        answer = client.post("/v1/imprint/resume", json=body).json()
        if answer["disk_tokens"] >= answer["ram_tokens"] > 0:
            return answer
        time.sleep(0.1)
    raise AssertionError(answer)


def test_without_the_store_the_routes_answer_404(served_model: str) -> None:
    with local_client(served_model) as client:
        assert "store" not in client.get("/health").json()
        assert "tensorfold:store_bytes" not in client.get("/metrics").text
        for method, path in [("POST", "/v1/imprint/resume"), ("POST", "/v1/imprint/load"), ("DELETE", "/v1/imprint")]:
            response = client.request(method, path, json=_body([{"role": "user", "content": "Hi"}]))
            assert response.status_code == 404
            assert response.json()["error"]["message"] == OFF_MESSAGE


@pytest.fixture(scope="module", params=["tiny-glm", "qwen3_5_text"])
def store_model(request: pytest.FixtureRequest, served_model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The trained tiny-glm, and a hybrid (Gated DeltaNet) one with its tokenizer and chat template, whose
    recurrent states are stored beside its KV rows."""
    if request.param == "tiny-glm":
        return served_model
    from serve_app.fixtures.checkpoints import build_random_checkpoint
    from serve_app.fixtures.tokenizer_builder import build_tokenizer

    out = tmp_path_factory.mktemp(request.param)
    build_tokenizer(out, vocab_size=512, family="glm")
    build_random_checkpoint(request.param, out, vocab_size=512, seed=3)
    template = REPO / "serve_app" / "fixtures" / "tiny_glm" / "chat_template.jinja"
    (out / "chat_template.jinja").write_text(template.read_text(encoding="utf-8"), encoding="utf-8")
    return str(out)


def test_a_conversation_resumes_from_disk_after_a_restart(store_model: str, tmp_path: Path) -> None:
    served_model, hybrid = store_model, not store_model.startswith("builtin:")
    first_turn = [{"role": "user", "content": OPENING}]
    with _client(served_model, tmp_path) as client:
        first = client.post("/v1/chat/completions", json=_body(first_turn)).json()
        second_turn = [
            *first_turn,
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "What time does it open?"},
        ]
        kept = _wait_on_disk(client, _body(second_turn))
        assert kept["resume_from"] == "ram" and kept["disk"] is True and kept["tokens"] > kept["ram_tokens"]
        assert "loaded_tokens" not in kept
        bad = client.post("/v1/imprint/resume", json={"model": "tiny"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
        too_long = client.post("/v1/imprint/load", json={**_body(second_turn), "max_tokens": 10**6}).json()["error"]
        assert (too_long["param"], too_long["code"]) == ("messages", "context_length_exceeded")  # as chat refuses it
    with _client(served_model, tmp_path) as client:  # a restart: RAM is empty, the disk holds the state
        answer = client.post("/v1/imprint/resume", json=_body(second_turn)).json()
        assert answer["resume_from"] == "disk" and answer["ram_tokens"] == 0
        assert answer["disk_tokens"] == kept["disk_tokens"] and answer["disk_bytes"] > 0 and answer["wait_seconds"] > 0
        resumed = client.post("/v1/chat/completions", json=_body(second_turn)).json()
        assert resumed["usage"]["prompt_tokens_details"]["cached_tokens"] >= answer["disk_tokens"]
        metrics = client.get("/metrics").text
        restored = [line for line in metrics.splitlines() if line.startswith("tensorfold:store_restored_tokens_total")]
        assert float(restored[0].split()[-1]) == answer["disk_tokens"]
        store = client.get("/health").json()["store"]
        assert store["pieces_read"] >= 1 and store["bytes_held"] > 0 and store["damaged_pieces"] == 0
        assert store["states_read"] == (1 if hybrid else 0)  # a hybrid's snapshot, read with the KV rows
        assert client.get("/stats").json()["store"]["restored_tokens"] == answer["disk_tokens"]  # the dashboard
    with _client(served_model, tmp_path / "elsewhere") as client:  # a fresh server, no states anywhere
        fresh = client.post("/v1/chat/completions", json=_body(second_turn)).json()
        assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert resumed["choices"][0]["message"] == fresh["choices"][0]["message"]
    assert resumed["tensorfold"]["token_sha"] == fresh["tensorfold"]["token_sha"]


def test_load_reads_the_state_into_ram_and_delete_forgets_it(served_model: str, tmp_path: Path) -> None:
    turn = [{"role": "user", "content": OPENING}]
    with _client(served_model, tmp_path) as client:
        client.post("/v1/chat/completions", json=_body(turn))
        _wait_on_disk(client, _body(turn + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "?"}]))
    with _client(served_model, tmp_path) as client:
        loaded = client.post("/v1/imprint/load", json=_body(turn)).json()
        assert loaded["loaded_tokens"] > 0 and loaded["load_seconds"] > 0 and loaded["resume_from"] == "ram"
        again = client.post("/v1/imprint/load", json=_body(turn)).json()
        assert again["loaded_tokens"] == 0 and again["load_seconds"] == 0  # RAM already holds as much
        freed = client.delete("/v1/imprint").json()["freed_bytes"]
        assert freed > 0 and not list(tmp_path.rglob("*.piece"))
        assert (tmp_path / "written").exists() and (tmp_path / "clock").exists()
        after = client.post("/v1/imprint/resume", json=_body(turn)).json()
        assert after["disk_tokens"] == 0 and after["ram_tokens"] > 0  # RAM's states stay until evicted


def test_a_shared_prefix_is_stored_once(served_model: str, tmp_path: Path) -> None:
    system = {"role": "system", "content": OPENING}
    with _client(served_model, tmp_path) as client:

        def stored_after(question: str) -> int:
            turn = [system, {"role": "user", "content": question}]
            client.post("/v1/chat/completions", json=_body(turn))
            _wait_on_disk(
                client, _body(turn + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "?"}])
            )
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the figures refresh once the engine is idle again
                store = client.get("/health").json()["store"]
                if store["pieces_written"] == pieces + 1:
                    return store["bytes_held"]
                time.sleep(0.05)
            raise AssertionError(store)

        pieces = 0
        first = stored_after("Which note is first? " * 8)
        pieces = 1
        both = stored_after("Which note is last, and why? " * 8)
    assert 0 < both - first < 0.3 * first  # the second conversation added its own blocks only


def test_a_damaged_piece_costs_a_prompt_pass_not_the_reply(served_model: str, tmp_path: Path) -> None:
    turn = [{"role": "user", "content": OPENING}]
    later = turn + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "And then?"}]
    with _client(served_model, tmp_path) as client:
        client.post("/v1/chat/completions", json=_body(turn))
        _wait_on_disk(client, _body(later))
    for piece in tmp_path.rglob("*.piece"):  # flip one byte of every piece's payload
        raw = bytearray(piece.read_bytes())
        raw[-1] ^= 0xFF
        piece.write_bytes(bytes(raw))
    with _client(served_model, tmp_path) as client:
        assert client.post("/v1/imprint/resume", json=_body(later)).json()["resume_from"] == "disk"
        damaged = client.post("/v1/chat/completions", json=_body(later)).json()
        assert damaged["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # prefilled instead
        assert not list(tmp_path.rglob("*.piece"))  # deleted, with the states that needed it
        metrics = client.get("/metrics").text
        assert any(
            line.startswith("tensorfold:store_damaged_pieces_total") and float(line.split()[-1]) >= 1
            for line in metrics.splitlines()
        )
    with _client(served_model, tmp_path / "fresh") as client:
        fresh = client.post("/v1/chat/completions", json=_body(later)).json()
    assert damaged["choices"][0]["message"] == fresh["choices"][0]["message"]


class _StoreThatGoesDown(LocalStoreLink):
    """The node's store, whose actor stops answering while `down` is set (as while Ray restarts it)."""

    down = False

    def _answer(self) -> None:
        if _StoreThatGoesDown.down:
            raise StoreFailedError(UNANSWERED)

    def _carry(self, call: StoreCall[Any]) -> object:
        self._answer()
        return super()._carry(call)

    def write(self, piece: PieceWrite) -> None:
        self._answer()
        super().write(piece)


def _metric(client: TestClient, name: str) -> float:
    (line,) = [line for line in client.get("/metrics").text.splitlines() if line.startswith(name + "{")]
    return float(line.split()[-1])


def test_while_the_store_is_down_nothing_is_claimed_from_disk_and_delete_answers_503(
    served_model: str, tmp_path: Path
) -> None:
    turn = [{"role": "user", "content": OPENING}]
    later = _body(turn + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "And then?"}])
    with _client(served_model, tmp_path, _StoreThatGoesDown) as client:
        client.post("/v1/chat/completions", json=_body(turn))
        kept = _wait_on_disk(client, later)
        _StoreThatGoesDown.down = True
        try:
            down = client.post("/v1/imprint/resume", json=later).json()
            assert down["disk_tokens"] == 0 and down["resume_from"] == "ram" and down["ram_tokens"] > 0
            refused = client.delete("/v1/imprint")
            assert refused.status_code == 503 and refused.json()["error"]["message"] == DELETE_REFUSED
            assert refused.json()["error"]["type"] == "server_error"
            store = client.get("/health").json()["store"]
            assert store["available"] is False and "not answering" in store["unavailable_reason"]
            assert _metric(client, "tensorfold:store_available") == 0
            failures = [
                line for line in client.get("/metrics").text.splitlines() if "store_write_failures_total{" in line
            ]
            assert sorted(line.split('reason="')[1].split('"')[0] for line in failures) == [
                "io_error",
                "no_space",
                "permission",
                "unavailable",
            ]
        finally:
            _StoreThatGoesDown.down = False
        assert list(tmp_path.rglob("*.piece"))  # nothing was deleted
        deadline = time.monotonic() + 30
        while (back := client.post("/v1/imprint/resume", json=later).json())["disk_tokens"] == 0:
            assert time.monotonic() < deadline, back  # the index is asked for again after a pause
            time.sleep(0.2)
        assert back["disk_tokens"] == kept["disk_tokens"]
        assert client.get("/health").json()["store"]["available"] is True
        assert client.delete("/v1/imprint").json()["freed_bytes"] > 0
        assert not list(tmp_path.rglob("*.piece"))

"""API keys and route protection over the real routes, renderer and engine, in-process (no Ray).

Key sources and labels, the 0600 rule, digests only, 401s in each route's format, open routes, rotation
(mtime at most once a second; a broken file closes, a fixed one reopens), labels in the request log.
"""

import logging
import os
import signal
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from deployments.ingress.http.key_store import KeyStore
from deployments.ingress.http.keys import (
    KeyFileError,
    auth_settings,
    digest_of,
    entries_from_env,
    parse_key_file,
    read_key_file,
)
from serve_app.cli_serve import _StopSignal
from serve_app.listen_checks import exposure_warning, raise_open_file_limit
from tests.support.local_app import local_backend

FILE_KEY = "sk-file-alpha-123"
CLI_KEY = "sk-cli-one"


def write_keys(path: Path, text: str, mode: int = 0o600) -> Path:
    """Replace atomically, as an operator should: write a sibling, then rename over."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    return path


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def backend(served_model: str):
    with local_backend(served_model) as value:
        yield value


@pytest.fixture()
def key_file(tmp_path: Path) -> Path:
    return write_keys(tmp_path / "keys", f"# team keys\nalpha: {FILE_KEY}\n\nsk-unnamed-2\n")


def client_for(backend, settings: IngressSettings) -> TestClient:
    return TestClient(build_api(backend, settings))


@pytest.fixture()
def keyed(backend, key_file: Path) -> TestClient:
    auth = auth_settings([CLI_KEY], str(key_file), metrics_open=False, env_value="sk-env-a, sk-env-b,")
    return client_for(backend, IngressSettings(served_name="tiny", model_ids=["tiny"], auth=auth))


def test_sources_add_up_with_labels_and_only_digests_travel(key_file: Path) -> None:
    auth = auth_settings([CLI_KEY, "sk-cli-two"], str(key_file), False, "sk-env-a,,sk-env-b")
    assert [e.label for e in auth.fixed] == ["cli-1", "cli-2", "env-1", "env-2"]
    assert [e.label for e in read_key_file(key_file)] == ["alpha", "file-1"]
    dumped = auth.model_dump_json()
    assert CLI_KEY not in dumped and "sk-env-a" not in dumped and FILE_KEY not in dumped
    assert digest_of(CLI_KEY) in dumped
    assert entries_from_env(None) == [] and entries_from_env(" , ") == []


@pytest.mark.parametrize(
    "text, problem",
    [
        ("", "no keys"),
        ("# only a comment\n\n", "no keys"),
        ("bad label!: sk-x\n", "line 1"),
        ("a: sk-1\na: sk-2\n", "repeats a label"),
        ("ok: \n", "line 1"),
        (f"{'x' * 65}: sk-1\n", "line 1"),
    ],
)
def test_malformed_key_files_are_refused(text: str, problem: str) -> None:
    with pytest.raises(KeyFileError, match=problem):
        parse_key_file(text)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_file_readable_by_others_refuses_startup(tmp_path: Path, mode: int) -> None:
    path = write_keys(tmp_path / "keys", f"{FILE_KEY}\n", mode)
    with pytest.raises(KeyFileError, match="chmod 600"):
        auth_settings([], str(path), False, None)


def test_missing_and_wrong_keys_get_401_in_the_routes_format(keyed: TestClient) -> None:
    wrong = ({}, {"Authorization": "Bearer nope"}, {"x-api-key": "nope"}, {"Authorization": f"Basic {CLI_KEY}"})
    for headers in wrong:
        reply = keyed.post("/v1/chat/completions", json={"messages": []}, headers=headers)
        assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert "nope" not in error["message"]
    reply = keyed.post("/v1/messages", json={}, headers={"x-api-key": "nope"})
    assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
    assert reply.json() == {"type": "error", "error": {"type": "authentication_error", "message": "invalid API key"}}
    assert keyed.post("/v1/messages/count_tokens", json={}).json()["type"] == "error"


def test_every_protected_route_needs_a_key(keyed: TestClient) -> None:
    routes = (
        ("GET", "/v1/models"),
        ("POST", "/tokenize"),
        ("POST", "/v1/detokenize"),
        ("GET", "/metrics"),
        ("GET", "/v1/metrics"),
        ("GET", "/memory"),
        ("GET", "/v1/unknown"),
        ("GET", "/openapi.json"),
    )
    for method, path in routes:
        assert keyed.request(method, path).status_code == 401, path


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": f"Bearer {CLI_KEY}"},
        {"authorization": f"bearer {FILE_KEY}"},
        {"x-api-key": "sk-env-b"},
        {"x-api-key": "sk-unnamed-2"},
    ],
)
def test_each_source_and_header_is_accepted(keyed: TestClient, headers: dict[str, str]) -> None:
    reply = keyed.post("/v1/tokenize", json={"prompt": "hello"}, headers=headers)
    assert reply.status_code == 200 and reply.json()["count"] > 0


def test_health_is_open_and_says_only_ok(keyed: TestClient, backend) -> None:
    for path in ("/health", "/"):
        assert keyed.get(path).json() == {"status": "ok"}
        assert keyed.get(path, headers={"x-api-key": CLI_KEY}).json() == {"status": "ok"}
        probe = keyed.head(path)  # Claude Code probes `HEAD /` before its first request
        assert probe.status_code == 200 and probe.content == b""
    open_client = client_for(backend, IngressSettings(served_name="tiny", model_ids=["tiny"]))
    assert "live" in open_client.get("/health").json()  # no keys: the details stay
    assert open_client.get("/v1/models").status_code == 200


def test_metrics_open_opens_both_metrics_routes_only(backend) -> None:
    auth = auth_settings([CLI_KEY], None, metrics_open=True, env_value=None)
    client = client_for(backend, IngressSettings(served_name="tiny", model_ids=["tiny"], auth=auth))
    for path in ("/metrics", "/v1/metrics"):
        assert client.get(path).status_code != 401
    assert client.get("/v1/models").status_code == 401


def test_labels_in_the_request_log_never_keys(keyed: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorfold.access")
    keyed.post("/v1/tokenize", json={"prompt": "hi"}, headers={"Authorization": f"Bearer {FILE_KEY}"})
    keyed.post("/v1/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer sk-wrong"})
    text = caplog.text
    assert "POST /v1/tokenize status=200 key=alpha" in text and "status=401 key=-" in text
    for secret in (FILE_KEY, "sk-wrong", digest_of(FILE_KEY), digest_of(FILE_KEY)[:16]):
        assert secret not in text


def test_rotation_checks_mtime_once_a_second_and_broken_files_close(key_file: Path) -> None:
    clock = Clock()
    store = KeyStore(auth_settings([CLI_KEY], str(key_file), False, None), clock)
    assert store.keys().match(FILE_KEY) == "alpha"
    write_keys(key_file, "beta: sk-new-key\n")
    clock.now += 0.5
    assert store.keys().match(FILE_KEY) == "alpha"  # not checked again within the second
    clock.now += 0.6
    keys = store.keys()
    assert keys.match("sk-new-key") == "beta" and keys.match(FILE_KEY) is None and keys.match(CLI_KEY) == "cli-1"
    for broken in ("", "# nothing\n", "bad label!: k\n"):
        write_keys(key_file, broken)
        clock.now += 1.1
        assert store.keys() is None and store.problem  # closed: even the fixed keys are refused
    write_keys(key_file, "gamma: sk-g\n", mode=0o644)
    clock.now += 1.1
    assert store.keys() is None and "chmod 600" in store.problem
    key_file.unlink()
    clock.now += 1.1
    assert store.keys() is None
    write_keys(key_file, "gamma: sk-g\n")
    store.reload()  # what a reload request does: at once, without waiting for the second
    assert store.keys().match("sk-g") == "gamma" and store.problem is None


def test_broken_file_answers_401_and_a_fixed_one_reopens(backend, key_file: Path) -> None:
    auth = auth_settings([], str(key_file), False, None)
    app = build_api(backend, IngressSettings(served_name="tiny", model_ids=["tiny"], auth=auth))
    client = TestClient(app)
    store = next(m.kwargs["store"] for m in app.user_middleware if "store" in m.kwargs)
    headers = {"x-api-key": FILE_KEY}
    assert client.get("/v1/models", headers=headers).status_code == 200
    write_keys(key_file, "")
    store.reload()
    reply = client.get("/v1/models", headers=headers)
    assert reply.status_code == 401 and "key file" in reply.json()["error"]["message"]
    assert client.get("/health").json() == {"status": "ok"}
    write_keys(key_file, f"alpha: {FILE_KEY}\n")
    store.reload()
    assert client.get("/v1/models", headers=headers).status_code == 200


def test_sighup_wakes_the_serving_loop_to_reload() -> None:
    stop = _StopSignal()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    reloads: list[int] = []
    try:
        stop.install()
        stop.serving = True
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGTERM)
        stop.wait_for_stop(lambda: reloads.append(1))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert len(reloads) == 2 and stop.received == "SIGTERM"


def test_exposure_warning_and_open_file_limit() -> None:
    assert exposure_warning("127.0.0.1", False) is None and exposure_warning("::1", False) is None
    assert exposure_warning("localhost", False) is None
    assert "without API keys" in exposure_warning("0.0.0.0", False)
    assert exposure_warning("0.0.0.0", True) is None
    limits = raise_open_file_limit()
    assert limits is not None and limits[1] >= limits[0]

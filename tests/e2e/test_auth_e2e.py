"""Keys, rotation, reload requests and hostile clients on the real graph (Ray Serve, HTTP, official SDKs).

One app from configs/glm.yaml with a 0600 key file; then the same app redeployed without keys (only the
Ingress restarts) for the disconnect storm, whose effect is read from /health's live counters.
"""

import asyncio
import json
import os
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from deployments.ingress.http.key_store import request_reload
from deployments.ingress.http.keys import digest_of
from serve_app.cli import main as cli_main
from tests.support.serve_harness import delete_apps, deploy_apps, load_app_config

pytestmark = pytest.mark.e2e
APP = "e2e-auth"
PREFIX = "/auth"
KEY = "sk-e2e-alpha-0001"
USER = [{"role": "user", "content": "What is the capital of France?"}]


def write_keys(path: Path, text: str, mode: int = 0o600) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    write_keys(path, f"# e2e\nalpha: {KEY}\n")
    return path


@pytest.fixture(scope="module")
def base_url(serve_url: str, served_model: str, key_file: Path) -> str:
    deploy_apps([load_app_config("glm.yaml", APP, PREFIX, model=served_model, name="tiny", api_key_file=str(key_file))])
    yield f"{serve_url}{PREFIX}"
    delete_apps([APP])


def status_with(base_url: str, key: str) -> int:
    return httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code


def wait_for_status(base_url: str, key: str, status: int, within_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < within_s:
        if status_with(base_url, key) == status:
            return time.monotonic() - started
        time.sleep(0.05)
    pytest.fail(f"key did not get {status} within {within_s} s")


def test_a_0644_key_file_refuses_startup(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    open_file = tmp_path / "keys"
    write_keys(open_file, f"{KEY}\n", 0o644)
    assert cli_main(["serve", "builtin:tiny-glm", "--api-key-file", str(open_file)]) == 2
    assert "chmod 600" in capsys.readouterr().err
    from serve_app.app import build_app
    from serve_app.args import AppArgs

    with pytest.raises(ValueError, match="accessible by group or others"):  # the `serve run` path
        build_app(AppArgs(api_key_file=str(open_file)))


def test_401s_carry_the_header_and_each_routes_envelope(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=4)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    assert info.value.response.headers["www-authenticate"] == "Bearer"
    messages = anthropic.Anthropic(base_url=base_url, api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as ainfo:
        messages.messages.create(model="tiny", max_tokens=4, messages=USER)
    expected = {"type": "error", "error": {"type": "authentication_error", "message": "invalid API key"}}
    assert ainfo.value.body == expected
    reply = httpx.post(f"{base_url}/tokenize", json={"prompt": "hi"})
    assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}


def test_a_valid_key_serves_and_labels_the_request_log(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert httpx.post(f"{base_url}/v1/tokenize", json={"prompt": "hi"}, headers={"x-api-key": KEY}).status_code == 200
    logs = _ray_logs()
    deadline = time.monotonic() + 10
    while "POST /v1/chat/completions status=200 key=alpha" not in logs and time.monotonic() < deadline:
        time.sleep(0.5)
        logs = _ray_logs()
    assert "POST /v1/chat/completions status=200 key=alpha" in logs
    metrics = httpx.get(f"{base_url}/metrics", headers={"x-api-key": KEY}).text
    for secret in (KEY, digest_of(KEY), digest_of(KEY)[:16]):
        assert secret not in logs and secret not in metrics


def test_rotation_within_about_a_second(base_url: str, key_file: Path) -> None:
    write_keys(key_file, "beta: sk-e2e-beta-0002\n")
    assert wait_for_status(base_url, "sk-e2e-beta-0002", 200, within_s=5) < 3.0
    assert status_with(base_url, KEY) == 401


def test_a_reload_request_applies_a_change_the_mtime_check_cannot_see(base_url: str, key_file: Path) -> None:
    before = key_file.stat()
    with open(key_file, "w") as handle:  # same inode, same size, mtime put back: only a reload sees it
        handle.write("gamma: sk-e2e-gam-0003\n")  # as long as the beta line it replaces
    os.utime(key_file, ns=(before.st_atime_ns, before.st_mtime_ns))
    time.sleep(1.5)
    assert status_with(base_url, "sk-e2e-gam-0003") == 401
    outcomes = request_reload(APP)  # what SIGHUP to `tensorfold serve` does
    assert outcomes and all(o.startswith("loaded") for o in outcomes)
    assert status_with(base_url, "sk-e2e-gam-0003") == 200


def test_a_broken_replacement_closes_and_a_fixed_one_reopens(base_url: str, key_file: Path) -> None:
    write_keys(key_file, "")
    wait_for_status(base_url, "sk-e2e-gam-0003", 401, within_s=5)
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    write_keys(key_file, f"alpha: {KEY}\n")
    wait_for_status(base_url, KEY, 200, within_s=5)


def test_hostile_bodies_on_the_graph(base_url: str) -> None:
    headers = {"x-api-key": KEY, "content-type": "application/json"}
    for body in (b"{", b'{"messages": "x"}', b"\xff\xfe", b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}"):
        reply = httpx.post(f"{base_url}/v1/chat/completions", content=body, headers=headers, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["message"]
    big = json.dumps({"prompt": "a" * (20 << 20)}).encode()
    reply = httpx.post(f"{base_url}/v1/completions", content=big, headers=headers, timeout=60)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"


async def _storm(host: str, port: int, path: str, connections: int, streams: int) -> None:
    """Connections that open and drop (some mid-request), and streams dropped after their first bytes."""
    body = json.dumps(
        {"model": "tiny", "messages": USER, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    ).encode()
    request = (
        f"POST {path}/v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body

    async def one(i: int) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        if i < streams:
            writer.write(request)
            await writer.drain()
            await asyncio.wait_for(reader.read(200), timeout=60)  # the headers or a first chunk: then leave
        elif i % 2:
            writer.write(request[: len(request) // 2])  # half a request, then gone
        writer.close()

    gate = asyncio.Semaphore(100)

    async def bounded(i: int) -> None:
        async with gate:
            await one(i)

    await asyncio.gather(*(bounded(i) for i in range(connections)))


def test_a_disconnect_storm_leaves_nothing_running(serve_url: str, served_model: str, base_url: str) -> None:
    deploy_apps([load_app_config("glm.yaml", APP, PREFIX, model=served_model, name="tiny")])  # keys off
    url = httpx.URL(serve_url)
    asyncio.run(_storm(url.host, url.port, PREFIX, connections=1000, streams=12))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        live = httpx.get(f"{base_url}/health", timeout=30).json()
        if live["live"]["connections"] == 0 and live["requests_running"] == 0:
            break
        time.sleep(0.3)
    else:
        pytest.fail(f"requests still running after the storm: {live}")
    from ray import serve

    statuses = serve.get_deployment_handle("Scheduler", APP).broadcast("info").results(timeout_s=30)
    assert all(s.running == 0 and s.waiting == 0 and s.kv_usage == 0 for s in statuses)
    reply = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": USER, "max_tokens": 4}, timeout=60)
    assert reply.status_code == 200


def _ray_logs() -> str:
    import ray

    logs_dir = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    chunks = []
    for path in logs_dir.rglob("*"):
        if path.is_file() and path.suffix in (".log", ".err", ".out"):
            chunks.append(path.read_text(errors="replace"))
    return "\n".join(chunks)

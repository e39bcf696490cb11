"""--dashboard: /dashboard and /stats answer only when on; the page, in headless Chromium, draws live data.

The browser test serves the real routes (in-process engine) with uvicorn, keeps chat traffic going on a
thread, loads the page in Debian's `chromium` driven over the DevTools protocol (real time, so the page
polls as it would for an operator), reads what the page recorded on <body> (polls that succeeded, the
requests it saw finish, any error) and fails on any page exception, then saves a screenshot.
"""

import base64
import itertools
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from websockets.sync.client import connect

from deployments.chat_format.rendering import PromptRenderer
from deployments.config import EngineConfig
from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from serve_app.local_backend import LocalBackend
from tests.support.bodies import USER

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PAGE_WAIT_S = 40.0


@pytest.fixture(scope="module")
def backend(served_model: str) -> Iterator[LocalBackend]:
    from deployments.scheduler.engine.core import Engine
    from deployments.scheduler.transports.thread import EngineLoop
    from serve_app.args import AppArgs

    model_dir = AppArgs(model=served_model).model_dir
    loop = EngineLoop(Engine(EngineConfig(model=str(model_dir), context=160, kv_cache_gib=0.05, device="cpu")))
    loop.start()
    yield LocalBackend(PromptRenderer.from_checkpoint(model_dir), loop)
    loop.shutdown()


def settings(dashboard: bool) -> IngressSettings:
    return IngressSettings(served_name="tiny", model_ids=["tiny"], dashboard=dashboard)


def test_both_routes_404_when_off(backend: LocalBackend) -> None:
    with TestClient(build_api(backend, settings(False))) as client:
        for path in ("/dashboard", "/stats"):
            response = client.get(path)
            assert response.status_code == 404
            assert "--dashboard" in response.json()["error"]["message"]


def test_stats_snapshot_after_a_request(backend: LocalBackend) -> None:
    with TestClient(build_api(backend, settings(True))) as client:
        page = client.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "<script" in page.text and "http://" not in page.text and "https://" not in page.text  # no CDN
        before = client.get("/stats").json()["totals"]["requests_total"]
        usage = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 6}).json()["usage"]
        stats = client.get("/stats").json()
    assert stats["totals"]["requests_total"] == before + 1
    assert stats["totals"]["completion_tokens_total"] >= usage["completion_tokens"]
    assert stats["histograms"]["ttft"]["count"] == stats["totals"]["requests_total"]
    assert [r["replica"] for r in stats["replicas"]] == ["local"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def live_server(backend: LocalBackend) -> Iterator[str]:
    import uvicorn

    port = _free_port()
    config = uvicorn.Config(build_api(backend, settings(True)), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def _traffic(base: str, stop: threading.Event) -> None:
    with httpx.Client(base_url=base, timeout=60) as client:
        while not stop.is_set():
            client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 8, "ignore_eos": True})


class Browser:
    """Headless Chromium driven over the DevTools protocol: navigate, evaluate, watch for page errors."""

    def __init__(self, profile: Path) -> None:
        command = [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            "--window-size=1280,1000",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "about:blank",
        ]
        env = {**os.environ, "HOME": str(profile)}
        self._process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
        self.errors: list[str] = []
        self._ids = itertools.count(1)
        self._socket = connect(self._page_socket(), max_size=None, open_timeout=30)

    def _page_socket(self) -> str:
        assert self._process.stderr is not None
        for line in self._process.stderr:  # Chromium prints where its DevTools endpoint listens
            match = re.search(r"DevTools listening on ws://([^/]+)/", line)
            if match:
                targets = httpx.get(f"http://{match.group(1)}/json/list", timeout=10).json()
                return next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        raise AssertionError("chromium exited before opening its DevTools endpoint")

    def call(self, method: str, **params: object) -> dict:
        call_id = next(self._ids)
        self._socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(self._socket.recv(timeout=30))
            if message.get("method") == "Runtime.exceptionThrown":
                self.errors.append(json.dumps(message["params"]["exceptionDetails"])[:500])
            elif message.get("method") == "Runtime.consoleAPICalled" and message["params"]["type"] == "error":
                self.errors.append(json.dumps(message["params"]["args"])[:500])
            if message.get("id") == call_id:
                assert "error" not in message, message
                return message["result"]

    def evaluate(self, expression: str) -> object:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def close(self) -> None:
        self._socket.close()
        self._process.kill()
        self._process.wait(timeout=10)


def _page_state(browser: Browser) -> dict[str, str]:
    return json.loads(str(browser.evaluate("JSON.stringify(document.body.dataset)")))


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
def test_dashboard_page_draws_live_traffic(live_server: str, tmp_path: Path) -> None:
    stop = threading.Event()
    traffic = threading.Thread(target=_traffic, args=(live_server, stop), daemon=True)
    traffic.start()
    browser = Browser(tmp_path / "profile")
    try:
        browser.call("Runtime.enable")
        browser.call("Page.enable")
        browser.call("Page.navigate", url=f"{live_server}/dashboard")
        deadline, state = time.monotonic() + PAGE_WAIT_S, {}
        while time.monotonic() < deadline:
            time.sleep(0.5)
            state = _page_state(browser)
            if (
                int(state.get("updates", 0)) >= 3
                and int(state.get("requests", 0)) >= 1
                and float(state.get("peakTokens", 0)) > 0
            ):
                break
        shot = tmp_path / "dashboard.png"
        shot.write_bytes(base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"]))
    finally:
        browser.close()
        stop.set()
        traffic.join(timeout=60)
    assert browser.errors == [], browser.errors
    assert state.get("error") == "", state
    assert int(state["updates"]) >= 3, state  # polls that answered and were drawn
    assert int(state["requests"]) >= 1, state  # requests finished while the page watched
    assert float(state["peakTokens"]) > 0, state  # the tokens/s chart drew live decoding
    assert shot.stat().st_size > 10_000
    print(f"dashboard screenshot: {shot}")


def test_quiet_poll_filter_drops_only_the_polls_access_lines() -> None:
    from deployments.ingress.ops.dashboard import QuietPollFilter

    def record(message: str, **extra: object) -> logging.LogRecord:
        item = logging.LogRecord("ray.serve", logging.INFO, __file__, 1, message, None, None)
        item.__dict__.update(extra)
        return item

    quiet = QuietPollFilter()
    assert not quiet.filter(record("GET /stats 200 1.2ms", serve_access_log=True, route="/stats"))
    assert not quiet.filter(record("GET /app/stats 200 1.2ms", serve_access_log=True, route="/app/stats"))
    chat = "/v1/chat/completions"
    assert quiet.filter(record(f"POST {chat} 200 9.0ms", serve_access_log=True, route=chat))
    assert quiet.filter(record("GET /stats 200 1.2ms"))  # not an access-log record: kept

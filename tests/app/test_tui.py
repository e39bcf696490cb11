"""`tensorfold tui`: driven headless with Textual's pilot against a real server (the routes and engine
in-process, served over TCP by uvicorn), with and without keys; and its screens on fixed readings."""

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn

from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from deployments.ingress.http.keys import auth_settings
from serve_app.cli import main
from serve_app.tui.app import MonitorApp, overview_text
from serve_app.tui.client import ServerAddress, ServerClient
from serve_app.tui.readings import Readings, ReplicaReading
from tests.support.local_app import local_backend

KEY = "sk-tui-test-key"
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "images"


@contextmanager
def running_server(backend, settings: IngressSettings) -> Iterator[str]:
    """The app on a free loopback port until the block ends."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_api(backend, settings), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def backend(served_model: str):
    with local_backend(served_model) as value:
        yield value


@pytest.fixture(scope="module")
def open_url(backend) -> Iterator[str]:
    with running_server(backend, IngressSettings(served_name="tiny", model_ids=["tiny"], dashboard=True)) as url:
        yield url


@pytest.fixture(scope="module")
def keyed_url(backend) -> Iterator[str]:
    auth = auth_settings([KEY], None, metrics_open=False, env_value=None)
    with running_server(backend, IngressSettings(served_name="tiny", model_ids=["tiny"], auth=auth)) as url:
        yield url


async def _settled(app: MonitorApp, pilot, state: str, until=lambda readings: True) -> None:
    """Wait until a poll has shown `state` and readings meeting `until` (polls run in a worker)."""
    for _ in range(400):
        await pilot.pause(0.05)
        if app.readings is not None and app.readings.state == state and until(app.readings):
            return
    raise AssertionError(f"state {state!r} never shown as awaited; last: {app.readings}")


async def _click_until_focused(app: MonitorApp, pilot, selector: str) -> None:
    """Click the widget until it has the focus: the first reading re-lays the screen out (the overview grows
    from one line to many), and a click aimed before that layout lands on another widget."""
    widget = app.query_one(selector)
    for _ in range(40):
        await pilot.click(selector)
        if app.focused is widget:
            return
        await pilot.pause(0.05)
    raise AssertionError(f"{selector} never took the focus; {app.focused} has it")


def test_live_view_shows_the_model_and_streams_a_chat(open_url: str) -> None:
    async def drive() -> tuple[Readings, str, str]:
        app = MonitorApp(ServerClient(ServerAddress(open_url)), interval=0.2)
        async with app.run_test(size=(120, 40)) as pilot:
            await _settled(app, pilot, "serving")
            await _click_until_focused(app, pilot, "#prompt")
            await pilot.press(*"Hello", "enter")
            for _ in range(400):
                await pilot.pause(0.05)
                if getattr(app, "last_reply", None):
                    break
            await _settled(app, pilot, "serving", lambda r: bool(r.requests_total))  # the reply, counted
            overview = str(app.query_one("#overview").render())
            return app.readings, overview, app.last_reply

    readings, overview, reply = asyncio.run(drive())
    assert readings.model == "tiny" and readings.context_length == 160
    assert readings.requests_total >= 1 and readings.ttft_p50 is not None and readings.latency_p99 is not None
    assert [r.name for r in readings.replicas] and readings.kv_usage is not None
    assert "model      tiny" in overview and "TTFT       p50" in overview
    assert reply.startswith("> Hello\n") and len(reply) > len("> Hello\n") and "[error" not in reply


def test_keyed_server_without_a_key_shows_the_401_screen(keyed_url: str) -> None:
    async def drive() -> tuple[Readings, str]:
        app = MonitorApp(ServerClient(ServerAddress(keyed_url)), interval=0.2)
        async with app.run_test(size=(120, 40)) as pilot:
            await _settled(app, pilot, "unauthorized")
            return app.readings, str(app.query_one("#banner").render())

    readings, banner = asyncio.run(drive())
    assert "Unauthorized" in banner and "--token-env" in banner


def test_keyed_server_with_the_key_from_the_environment_serves_figures(keyed_url: str) -> None:
    async def drive() -> Readings:
        client = ServerClient(ServerAddress(keyed_url, token=KEY, token_env="TF_KEY"))
        app = MonitorApp(client, interval=0.2)
        async with app.run_test(size=(120, 40)) as pilot:
            await _settled(app, pilot, "serving")
            return app.readings

    readings = asyncio.run(drive())
    assert readings.running is not None and readings.kv_usage is not None  # from /metrics, with the key


def test_wrong_key_names_the_variable() -> None:
    async def poll(url: str) -> Readings:
        client = ServerClient(ServerAddress(url, token="sk-wrong", token_env="TF_KEY"))
        try:
            return await client.poll()
        finally:
            await client.close()

    with socket.socket() as probe:  # nothing listens here
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    unreachable = asyncio.run(poll(dead))
    assert unreachable.state == "unreachable" and dead in unreachable.message


def test_the_refused_key_screen_names_its_variable(keyed_url: str) -> None:
    async def poll() -> Readings:
        client = ServerClient(ServerAddress(keyed_url, token="sk-wrong", token_env="TF_KEY"))
        try:
            return await client.poll()
        finally:
            await client.close()

    readings = asyncio.run(poll())
    assert readings.state == "unauthorized" and "$TF_KEY" in readings.message


def test_a_missing_token_variable_is_refused(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.delenv("TF_ABSENT", raising=False)
    assert main(["tui", "--url", "http://127.0.0.1:9", "--token-env", "TF_ABSENT"]) == 2
    assert "$TF_ABSENT is not set" in capsys.readouterr().err


FIXED = Readings(
    state="serving",
    model="qwen3-8b",
    policy="lanes=16 chunk=512 decode_share=0.5 threads=8 kv=bf16 drafts=ngram",
    context_length=32768,
    running=12,
    waiting=3,
    decode_tokens_per_second=412.5,
    prefill_tokens_per_second=5120.0,
    requests_total=1834,
    ttft_p50=0.084,
    ttft_p99=0.61,
    latency_p50=2.4,
    latency_p99=9.75,
    kv_usage=0.63,
    draft_acceptance=0.71,
    store={"bytes_held": 734003200, "pieces_written": 412},
    routing={"affinity": 1201, "balance": 410, "no_match": 223},
    replicas=[ReplicaReading("0", 7, 1, 0.66, 220.1, 2600.0), ReplicaReading("1", 5, 2, 0.6, 192.4, 2520.0)],
)


class FixedClient:
    """Readings that never change, so the screens can be compared as pictures."""

    address = ServerAddress("http://gpu-box:8000")

    def __init__(self, readings: Readings) -> None:
        self.readings = readings

    async def poll(self) -> Readings:
        return self.readings

    async def close(self) -> None:
        pass


def test_overview_lists_every_figure() -> None:
    text = overview_text(FIXED)
    for part in ("window 32,768", "running 12", "waiting 3", "decode 412.5 tok/s", "p99 610 ms", "p99 9.75 s"):
        assert part in text
    assert "63% of the fullest pool" in text and "71% accepted" in text and "affinity 1201" in text


@pytest.mark.parametrize(
    "name,readings",
    [
        ("serving", FIXED),
        ("loading", Readings(state="loading", message="Loading model")),
        ("unauthorized", Readings(state="unauthorized", message="the server refused the key in $TF_KEY (401)")),
    ],
)
def test_screens_match_their_snapshots(name: str, readings: Readings, snap_compare) -> None:
    assert snap_compare(MonitorApp(FixedClient(readings), interval=3600), terminal_size=(120, 32))


def test_the_docs_screenshot_is_the_serving_snapshot() -> None:
    snapshot = (
        Path(__file__).parent
        / "__snapshots__"
        / "test_tui"
        / "test_screens_match_their_snapshots[serving-readings0].svg"
    )
    assert (SCREENSHOTS / "tui.svg").read_text() == snapshot.read_text(), "copy the snapshot to docs/images/tui.svg"

"""`tensorfold serve` as a user runs it: its own Ray cluster, the Ingress replica answering HTTP on --port
itself (Serve's direct ingress), the official SDK against it, and SIGTERM taking everything down. The
server is started with the command line of the systemd unit `tensorfold service install` writes, so the
unit's ExecStart is proven to start a server.

The session's other e2e modules reach their apps through Serve's proxy, as `serve run` does; this module is
the only one on the direct path, so it checks the behaviour that depends on who owns the socket: who
listens, streamed and whole replies agreeing, refusals before work, and a client walking away.

The last tests stop things: an engine process killed (health turns 503 at once, a request meanwhile is
refused cleanly, and Serve replaces the replica), SIGTERM with eight streams in flight (the drain), and the
server restarted on the same port, then stopped by SIGTERM to every one of its processes at once, as
systemd's KillMode=control-group or a process-group kill stops it.

It also watches the loading window as a client sees it: the port opens while the Scheduler replica is still
loading the model (a few seconds, on tiny-glm too: the engine's own process imports torch and loads the
checkpoint, the Ingress replica only builds its routes). From the moment the port accepts, the fixture polls
/health and /v1/models and sends a chat request each round until /health answers 200.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_app.ray_network import is_loopback_host
from tests.conftest import REPO, free_port
from tests.support.serve_harness import (
    closed_by_the_server,
    listener_of,
    listening_sockets,
    process_tree,
    time_wait_on,
)
from tests.support.service_units import service_command

pytestmark = pytest.mark.e2e
USER = [{"role": "user", "content": "What is the capital of France?"}]
START_TIMEOUT_S = 300  # a fresh Ray cluster and the graph, on a 2-core machine beside the session's cluster
POLL_S = 0.2  # between two rounds of the loading watch
ENV_KEY = "tf-env-key-7f3a9c"  # a key given through TENSORFOLD_API_KEY to the restarted server
AUTHORIZED = {"Authorization": f"Bearer {ENV_KEY}"}
LOADING_REQUEST = {"model": "tiny", "messages": USER, "max_tokens": 16, "temperature": 0}
DRAIN_S = 2.0  # the server's drain grace: the long streams of the SIGTERM test outlast it
STOP_BUDGET_S = 30.0  # SIGTERM to exit: the drain's grace, the store's last writes, Serve and Ray stopping


@dataclass
class LoadingWindow:
    """What a client saw from the moment the port accepted until /health answered 200, round by round."""

    health: list[tuple[int, dict]] = field(default_factory=list)  # status and body
    models: list[list[str]] = field(default_factory=list)  # the ids /v1/models listed
    replies: list[tuple[int, dict]] = field(default_factory=list)  # the chat requests sent each round


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    lines: list[str] = field(default_factory=list)  # everything it printed (Ray forwards replica logs)
    loading: LoadingWindow = field(default_factory=LoadingWindow)
    time_wait_at_start: int = 0  # its port's TIME_WAIT sockets as it was launched (a restart's)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _collect(server: Server, ready: threading.Event) -> None:
    assert server.process.stdout is not None
    for line in server.process.stdout:
        server.lines.append(line)
        if line.startswith("tensorfold: serving"):
            ready.set()
    ready.set()  # it exited: let the waiter see why


def _wait_for_port(server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", server.port), timeout=0.2).close()
            return
        except OSError:
            assert server.process.poll() is None and time.monotonic() < deadline, "".join(server.lines[-40:])
            time.sleep(0.01)


def _chat(base: str) -> tuple[int, dict]:
    reply = httpx.post(f"{base}/v1/chat/completions", json=LOADING_REQUEST, timeout=120)
    return reply.status_code, reply.json()


def _watch_loading(server: Server) -> None:
    """Poll from the moment the port accepts until /health answers 200, sending a chat request each round."""
    _wait_for_port(server)
    window = server.loading
    sent: list[Future] = []
    with ThreadPoolExecutor(64) as pool:  # each round's request leaves at once
        while not window.health or window.health[-1][0] != 200:
            sent.append(pool.submit(_chat, server.base))
            health = httpx.get(f"{server.base}/health", timeout=30)
            window.health.append((health.status_code, health.json()))
            models = httpx.get(f"{server.base}/v1/models", timeout=30)
            window.models.append([m["id"] for m in models.json()["data"]])
            assert len(window.health) * POLL_S < START_TIMEOUT_S, window.health[-1]
            time.sleep(POLL_S)
        window.replies = [future.result() for future in sent]


def _launch(port: int, watch: bool = True, **env_vars: str) -> Server:
    """`tensorfold serve` on `port` with a Ray cluster of its own; returns once it says it is serving (and
    with `watch`, once /health answers 200, the loading window recorded)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a cluster of its own
    env.update(RAY_AUTH_MODE="disabled", PYTHONPATH=str(REPO), **env_vars)
    flags = ["builtin:tiny-glm", "--name", "tiny", "--port", str(port), "--parallel", "4", "--engine-threads", "1"]
    flags += ["--drain-timeout", str(DRAIN_S)]
    command = service_command(flags, env)  # what `tensorfold service install` would run
    time_wait = time_wait_on(port) if Path("/proc/net/tcp").exists() else 0
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    running = Server(process, port, time_wait_at_start=time_wait)
    ready = threading.Event()
    threading.Thread(target=_collect, args=(running, ready), daemon=True).start()
    try:
        if watch:
            _watch_loading(running)
        assert ready.wait(START_TIMEOUT_S) and process.poll() is None, "".join(running.lines[-40:])
    except BaseException:
        _stop(running)
        raise
    return running


def _stop(server: Server) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.process.kill()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    running = _launch(free_port())
    try:
        yield running
    finally:
        _stop(running)


@pytest.fixture(scope="module")
def restarted(server: Server) -> Iterator[Server]:
    """A supervisor's restart right after the drained stop (test_sigterm_drains_...), on the same port and now
    with TENSORFOLD_API_KEY set; the module's last test stops it."""
    assert server.process.poll() is not None, "the drained stop comes first"
    running = _launch(server.port, watch=False, TENSORFOLD_API_KEY=ENV_KEY)
    try:
        yield running
    finally:
        _stop(running)


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the socket table from Linux's /proc")
def test_the_ingress_replica_itself_listens_on_the_port(server: Server) -> None:
    assert "ServeReplica:tensorfold:Ingress" in listener_of(server.port)
    assert any(f"at http://127.0.0.1:{server.port}/v1 (ingress answers HTTP)" in line for line in server.lines)


def test_the_engine_computes_with_the_threads_asked_for(server: Server) -> None:
    assert " threads=1 " in httpx.get(f"{server.base}/health").json()["policy"]


def test_the_sdk_gets_equal_streamed_and_whole_replies(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    request = dict(model="tiny", messages=USER, max_tokens=24, temperature=0.8, seed=7)
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_health_says_loading_until_the_model_can_answer(server: Server) -> None:
    statuses = [status for status, _ in server.loading.health]
    loading = statuses.index(200)
    assert loading >= 1 and statuses[loading:] == [200], statuses  # the window was seen, and it ended once
    for status, body in server.loading.health[:loading]:
        assert status == 503 and body["status"] == "loading" and body["warming"] is True, body
        assert body["model"] == "tiny" and body["model_ids"] == ["tiny"], body
    assert server.loading.health[loading][1]["status"] == "ok"


def test_models_lists_the_model_only_once_it_can_answer(server: Server) -> None:
    listed = server.loading.models
    assert listed[0] == [] and listed[-1] == ["tiny"], listed  # /health said 200 before this last round's list
    first = listed.index(["tiny"])
    assert all(ids == [] for ids in listed[:first]) and all(ids == ["tiny"] for ids in listed[first:]), listed


def test_requests_sent_while_the_model_loads_wait_for_it(server: Server) -> None:
    replies = server.loading.replies
    assert len(replies) == len(server.loading.health) >= 2  # one sent each round, the first as the port opened
    after = _chat(server.base)
    assert after[0] == 200
    for status, body in replies:
        assert status == 200, body
        assert body["choices"][0]["message"] == after[1]["choices"][0]["message"]


def test_a_bad_request_is_refused_in_openai_format(server: Server) -> None:
    reply = httpx.post(f"{server.base}/v1/chat/completions", json={"messages": USER, "n": 2}, timeout=30)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "n" and error["type"] == "invalid_request_error"


def _disconnections(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "tensorfold:client_disconnections")
    return sum(s.value for s in family.samples if s.name.endswith("_total"))


def test_a_client_that_walks_away_stops_its_request(server: Server) -> None:
    before = _disconnections(server.base)
    body = {"messages": USER, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base}/v1/chat/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                break  # one token arrived: leave
    deadline = time.monotonic() + 30
    while _disconnections(server.base) <= before:
        assert time.monotonic() < deadline, "the request was not stopped upstream"
        time.sleep(0.2)
    assert httpx.get(f"{server.base}/health", timeout=30).json()["requests_running"] == 0


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the socket table from Linux's /proc")
def test_every_ray_port_stays_on_loopback(server: Server) -> None:
    """Ray's GCS, raylet, dashboard agent, metrics exporters and workers: nothing beyond 127.0.0.1/::1."""
    tree = process_tree(server.process.pid)
    sockets = listening_sockets(tree)
    names = " ".join(name for name, _, _ in sockets)
    assert "gcs_server" in names and "raylet" in names and "DashboardAgent" in names, sockets
    assert any("ServeReplica:tensorfold:Ingress" in name and port == server.port for name, _, port in sockets)
    exposed = [entry for entry in sockets if not is_loopback_host(entry[1])]
    assert not exposed and len(sockets) >= 8, exposed or sockets


def _engine_processes(root: int) -> list[int]:
    """The engine processes (transports/child.py) among `root`'s descendants, from Linux's /proc."""
    parents: dict[int, int] = {}
    engines: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except OSError:  # it exited meanwhile
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        if b"deployments.scheduler.transports.child" in command:
            engines.append(int(entry.name))

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == root:
                return True
        return False

    return [pid for pid in engines if descends(pid)]


def _health_until(base: str, status: int, timeout_s: float) -> tuple[float, dict]:
    """Poll /health until it answers `status`; returns when (monotonic) and the body."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = httpx.get(f"{base}/health", timeout=30)
        if reply.status_code == status:
            return time.monotonic(), reply.json()
        assert time.monotonic() < deadline, (reply.status_code, reply.text)
        time.sleep(0.05)


@pytest.mark.skipif(not Path("/proc/1/stat").exists(), reason="finds the engine process in Linux's /proc")
def test_a_killed_engine_turns_health_503_at_once_and_serve_replaces_it(server: Server) -> None:
    before = _chat(server.base)
    (engine,) = _engine_processes(server.process.pid)
    os.kill(engine, signal.SIGKILL)
    killed = time.monotonic()
    seen, body = _health_until(server.base, 503, timeout_s=10)
    assert seen - killed < 1.0, seen - killed
    assert body == {"status": "unavailable", "message": "the model is not serving: the engine process exited"}
    sent = time.monotonic()
    status, refused = _chat(server.base)  # during the outage: a clean error in the route's format, at once
    assert time.monotonic() - sent < 5.0
    assert status == 503 and refused["error"]["type"] == "server_error", refused
    assert "Traceback" not in refused["error"]["message"] and "not serving" in refused["error"]["message"]
    _, body = _health_until(server.base, 200, timeout_s=START_TIMEOUT_S)  # Serve started a new replica
    assert body["status"] == "ok"
    (replacement,) = _engine_processes(server.process.pid)
    assert replacement != engine
    after = _chat(server.base)
    assert after[0] == 200 and after[1]["choices"] == before[1]["choices"]  # token for token, from the new engine


@dataclass
class StreamEnd:
    """How one streamed request ended: its HTTP status and its events' JSON, or its error body."""

    status: int
    events: list[dict] = field(default_factory=list)
    done: bool = False  # `data: [DONE]` came last
    body: dict | None = None  # a request refused before its stream opened


def _stream(base: str, body: dict, first_token: threading.Semaphore, headers: dict | None = None) -> StreamEnd:
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers, timeout=120) as reply:
        if reply.status_code != 200:
            reply.read()
            return StreamEnd(reply.status_code, body=reply.json())
        end = StreamEnd(200)
        for line in reply.iter_lines():
            if line == "data: [DONE]":
                end.done = True
            elif line.startswith("data: "):
                assert not end.done, "an event after [DONE]"
                end.events.append(json.loads(line.removeprefix("data: ")))
                if len(end.events) == 1:
                    first_token.release()
        return end


def _completed(end: StreamEnd) -> bool:
    finishes = [c["finish_reason"] for e in end.events for c in e.get("choices", ()) if c.get("finish_reason")]
    return end.done and finishes in (["stop"], ["length"]) and "error" not in end.events[-1]


def _ended_with_error(end: StreamEnd) -> bool:
    last = end.events[-1] if end.events else {}
    return end.done and last.get("error", {}).get("message") == "the server is shutting down"


def test_sigterm_drains_the_streams_refuses_new_work_and_exits_quietly(server: Server) -> None:
    for _ in range(3):  # clients asking the server to close: its side of each connection lingers in TIME_WAIT
        assert closed_by_the_server(server.port).startswith(b"HTTP/1.1 200")
    assert time_wait_on(server.port) >= 3
    short = {"model": "tiny", "messages": USER, "max_tokens": 64, "ignore_eos": True, "stream": True}
    long = {**short, "max_tokens": 3000}
    first_token = threading.Semaphore(0)
    with ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(_stream, server.base, short, first_token) for _ in range(2)]
        for _ in range(2):  # the short ones run first, so they can finish within the grace
            assert first_token.acquire(timeout=60)
        streams += [pool.submit(_stream, server.base, long, first_token) for _ in range(6)]
        for _ in range(2):  # all four of the engine's lanes stream (the other long ones wait in its queue)
            assert first_token.acquire(timeout=60)
        server.process.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        _, body = _health_until(server.base, 503, timeout_s=5)
        assert body["status"] == "draining", body
        late = httpx.post(f"{server.base}/v1/chat/completions", json=LOADING_REQUEST, timeout=30)
        assert late.status_code == 503 and late.headers["Retry-After"].isdigit(), late.text
        assert late.json()["error"]["type"] == "server_error"
        ends = [stream.result(timeout=60) for stream in streams]
    for end in ends:  # a whole reply, or the error event then [DONE], or (still queued) a complete 503
        refused = end.status == 503 and end.body is not None and "shutting down" in end.body["error"]["message"]
        assert _completed(end) or _ended_with_error(end) or refused, end
    assert sum(_completed(end) for end in ends) >= 2  # the short ones finished within the grace
    assert any(_ended_with_error(end) for end in ends)  # the long ones that ran were ended, not cut
    assert server.process.wait(timeout=STOP_BUDGET_S) == 0, "".join(server.lines[-40:])
    assert time.monotonic() - stopped < STOP_BUDGET_S
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.base}/health", timeout=5)
    output = "".join(server.lines)
    assert "SIGTERM, draining" in output and "drained:" in output
    assert "SIGTERM received" not in output and "PC: @" not in output, output[-4000:]  # no native stack trace


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the socket table from Linux's /proc")
def test_a_restart_on_the_same_port_serves_at_once_and_keeps_the_env_key_out_of_ray(restarted: Server) -> None:
    """Right after the drained stop above (its TIME_WAIT sockets still on the port), a supervisor's restart, now with
    TENSORFOLD_API_KEY set: it serves, asks for the key, and no Ray process's environment holds the key."""
    assert restarted.time_wait_at_start >= 3
    assert httpx.get(f"{restarted.base}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{restarted.base}/v1/models", headers=AUTHORIZED, timeout=30).status_code == 200
    cli, *ray_processes = process_tree(restarted.process.pid)
    assert any(ENV_KEY in value for value in cli.environ().values())  # the reading works: the CLI was given it
    holding = [p.cmdline()[:1] for p in ray_processes if any(ENV_KEY in v for v in p.environ().values())]
    assert len(ray_processes) >= 8 and not holding, holding


def _running(processes: list[psutil.Process]) -> list[int]:
    """The pids still running (a zombie has exited: only its parent has not collected its status yet)."""
    running = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.status() != psutil.STATUS_ZOMBIE:
                running.append(process.pid)
    return running


def test_sigterm_to_every_process_at_once_drains_the_streams_and_the_whole_tree_exits(restarted: Server) -> None:
    """As systemd's KillMode=control-group, a process-group kill or `pkill` stop a server: SIGTERM to every
    process of it together (Ray's GCS, raylet and workers, the engine's own process). Ray's processes hold the
    signal (serve_app/launch.py), so the command drains as on a planned stop: four streams in flight each end
    with [DONE], and every process is gone within the stop budget. (Signalled too, Ray's raylet and GCS went
    first: the streams were cut, or the command waited a minute on a GCS that had stopped.)"""
    body = {"model": "tiny", "messages": USER, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    first_token = threading.Semaphore(0)
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(_stream, restarted.base, body, first_token, AUTHORIZED) for _ in range(4)]
        for _ in range(4):  # the engine's four lanes all stream
            assert first_token.acquire(timeout=60)
        tree = process_tree(restarted.process.pid)
        for process in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        ends = [stream.result(timeout=60) for stream in streams]
    assert all(end.status == 200 and _ended_with_error(end) for end in ends), ends  # [DONE] after the error event
    assert restarted.process.wait(timeout=STOP_BUDGET_S) == 0, "".join(restarted.lines[-40:])
    while _running(tree) and time.monotonic() - stopped < STOP_BUDGET_S:
        time.sleep(0.1)
    assert not _running(tree), _running(tree)
    output = "".join(restarted.lines)
    assert "SIGTERM, draining" in output and "drained: 0 request(s) finished, 4 ended" in output, output[-4000:]

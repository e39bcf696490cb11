"""`tensorfold serve` as a user runs it: its own Ray cluster, the Ingress replica answering HTTP on --port
itself (Serve's direct ingress), the official SDK against it, and SIGTERM taking everything down.

The session's other e2e modules reach their apps through Serve's proxy, as `serve run` does; this module is
the only one on the direct path, so it checks the behaviour that depends on who owns the socket: who
listens, streamed and whole replies agreeing, refusals before work, and a client walking away.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO, free_port
from tests.serve_harness import listener_of

pytestmark = pytest.mark.e2e
USER = [{"role": "user", "content": "What is the capital of France?"}]
START_TIMEOUT_S = 300  # a fresh Ray cluster and the graph, on a 2-core machine beside the session's cluster


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    lines: list[str] = field(default_factory=list)  # everything it printed (Ray forwards replica logs)

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


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a cluster of its own
    env.update(RAY_AUTH_MODE="disabled", PYTHONPATH=str(REPO))
    port = free_port()
    command = [sys.executable, "-m", "serve_app", "serve", "builtin:tiny-glm", "--name", "tiny", "--port", str(port),
               "--parallel", "4", "--engine-threads", "1"]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    running = Server(process, port)
    ready = threading.Event()
    threading.Thread(target=_collect, args=(running, ready), daemon=True).start()
    try:
        assert ready.wait(START_TIMEOUT_S) and process.poll() is None, "".join(running.lines[-40:])
        yield running
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


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


def test_sigterm_shuts_the_server_and_its_port_down(server: Server) -> None:
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=120) == 0, "".join(server.lines[-40:])
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.base}/health", timeout=5)
    assert any("SIGTERM, shutting down" in line for line in server.lines)

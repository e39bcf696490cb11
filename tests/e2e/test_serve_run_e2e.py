"""The README's first command, `serve run configs/glm.yaml`, as a user runs it: a Ray cluster of its own, and
the Ingress replica answering HTTP itself (direct ingress from the YAML's controller_options), not Serve's proxy.

The YAML is copied with its port (8080) replaced by a free one, so the test never collides with a server a
developer left running; everything else is the shipped file.
"""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from serve_app.ray_network import is_loopback_host, local_ray_env
from tests.conftest import REPO, free_port
from tests.support.serve_harness import listener_of, listening_sockets, process_tree

pytestmark = pytest.mark.e2e
START_TIMEOUT_S = 300


def _config_on(port: int, out: Path) -> Path:
    config = yaml.safe_load((REPO / "configs" / "glm.yaml").read_text())
    env = config["controller_options"]["runtime_env"]["env_vars"]
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == (
        "8080",
        "8081",
    )
    env.update(RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(port), RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=str(port + 1))
    (app,) = config["applications"]
    assert app["args"]["http_entry"] == "ingress" and app["args"]["port"] == 8080
    app["args"]["port"] = port
    path = out / "glm.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class Served:
    base: str  # http://127.0.0.1:PORT
    process: subprocess.Popen  # `serve run`, the parent of the Ray cluster it started


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    port = free_port()
    config = _config_on(port, tmp_path_factory.mktemp("serve-run"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_ADDRESS"] = "local"  # a cluster of its own, even where a `ray start` left its address behind
    env.update(RAY_AUTH_MODE="disabled", PYTHONPATH=str(REPO), **local_ray_env())  # the README's command
    serve = Path(sys.executable).with_name("serve")
    log = (tmp_path_factory.getbasetemp() / "serve-run.log").open("w")
    process = subprocess.Popen(
        [str(serve), "run", str(config)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and process.poll() is None:
            try:  # the model is listed once the Scheduler answers (the application is RUNNING)
                if httpx.get(f"{base}/v1/models", timeout=2).json().get("data"):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1)
        else:
            pytest.fail("serve run did not serve the model: " + Path(log.name).read_text()[-4000:])
        yield Served(base, process)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the socket table from Linux's /proc")
def test_the_ingress_replica_answers_on_the_yamls_port(served: Served) -> None:
    assert "ServeReplica:tensorfold:Ingress" in listener_of(int(served.base.rsplit(":", 1)[1]))


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the socket table from Linux's /proc")
def test_every_ray_port_stays_on_loopback(served: Served) -> None:
    sockets = listening_sockets(process_tree(served.process.pid))
    names = " ".join(name for name, _, _ in sockets)
    assert "gcs_server" in names and "raylet" in names and "ServeReplica:tensorfold:Ingress" in names, sockets
    exposed = [entry for entry in sockets if not is_loopback_host(entry[1])]
    assert not exposed and len(sockets) >= 8, exposed or sockets


def test_a_chat_reply_comes_back_through_the_direct_entry(served: Served) -> None:
    body = {
        "model": "tiny-glm",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 48,
    }
    response = httpx.post(f"{served.base}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert "Paris" in reply["choices"][0]["message"]["content"]

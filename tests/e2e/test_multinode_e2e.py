"""A Ray cluster of three nodes on this machine (`ray start --head`, two `ray start --address` workers with
their own resources), the app deployed onto it with `serve run --address` as an operator would:

- tensor parallel 2 with STRICT_SPREAD: the Scheduler replica and each rank on a node of its own, replies
  equal to tensor parallel 1 (the session's tiny-glm app) token for token;
- data parallel 2 with `max_replicas_per_node: 1`: the two model copies on different nodes, both answering;
  then the worker node of one copy killed mid-stream: its streams end with an error event, the other
  copy's complete, and a replacement copy serves from the node left.
"""

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.conftest import REPO, free_port
from tests.support.ray_nodes import LocalCluster, alive_nodes, start_cluster

pytestmark = pytest.mark.e2e
CONFIGS = REPO / "configs"
READY_TIMEOUT_S = 300
PROMPTS = [
    [{"role": "user", "content": text}] for text in ("What is the capital of France?", "Hello!", "Tell me about Tokyo.")
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # The head has room for the app's small actors, which Ray keeps on the caller's node while it has room:
    # so a worker node holds only Scheduler replicas and ranks, and losing one loses only those.
    running = start_cluster(["node_a", "node_b"], tmp_path_factory.mktemp("ray-nodes"), head_cpus=4)
    try:
        yield running
    finally:
        running.stop()


def _deploy(cluster: LocalCluster, config_name: str, tmp: Path, copies: int = 1, **args) -> str:
    """`serve run --address GCS --non-blocking` a repo config with `args` changed; returns its base URL once
    `/health` counts `copies` Scheduler replicas."""
    config = yaml.safe_load((CONFIGS / config_name).read_text())
    port = free_port()
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    config["applications"][0]["args"].update(args)
    path = tmp / f"{config_name}.yaml"
    path.write_text(yaml.safe_dump(config))
    serve = str(Path(sys.executable).parent / "serve")  # Ray's CLI, beside this interpreter
    command = [serve, "run", "--address", cluster.gcs_address, "--non-blocking", str(path)]
    result = subprocess.run(command, env=cluster.env, cwd=REPO, capture_output=True, text=True, timeout=READY_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            health = httpx.get(f"{base}/health", timeout=10)
            if health.status_code == 200 and health.json().get("replicas") == copies:
                return base
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the app did not become healthy"
        time.sleep(1)


def _shutdown_serve(cluster: LocalCluster) -> None:
    cluster.python("from ray import serve\nserve.shutdown()")


def _replies(base_url: str, **request) -> list[str]:
    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=180)
        replies = await asyncio.gather(
            *[client.chat.completions.create(model="tiny", messages=p, **request) for p in PROMPTS]
        )
        await client.close()
        return [r.choices[0].message.content or "" for r in replies]

    return asyncio.run(run())


def _groups_by_node(cluster: LocalCluster) -> list[list[str]]:
    """For every created placement group, the node name holding each bundle, in bundle order."""
    code = (
        "import json\nfrom ray.util import placement_group_table\n"
        "print(json.dumps([[g['bundles_to_node_id'][i] for i in sorted(g['bundles_to_node_id'])]"
        " for g in placement_group_table().values() if g['state'] == 'CREATED']))"
    )
    groups = json.loads(cluster.python(code).strip().splitlines()[-1])
    names = alive_nodes(cluster)
    return [[names[node] for node in group] for group in groups]


def test_tensor_parallel_ranks_on_three_nodes_reply_as_tensor_parallel_1(
    cluster: LocalCluster, glm_base_url: str, tmp_path: Path
) -> None:
    base = _deploy(cluster, "glm-tp2.yaml", tmp_path, placement_strategy="STRICT_SPREAD", name="tiny")
    try:
        (group,) = _groups_by_node(cluster)
        assert sorted(group) == ["node_a", "node_b", "node_head"]  # the replica and each rank: a node each
        greedy = dict(max_tokens=24, temperature=0)
        assert _replies(base, **greedy) == _replies(glm_base_url, **greedy)
        seeded = dict(max_tokens=24, temperature=0.8, seed=11)
        assert _replies(base, **seeded) == _replies(glm_base_url, **seeded)
    finally:
        _shutdown_serve(cluster)


def test_data_parallel_copies_on_two_nodes_and_a_worker_node_lost_mid_stream(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Both copies answer from their own nodes; then the worker node holding one copy dies (SIGKILL to its
    processes, as a crashed machine): its streams end with an error event and [DONE], the other copy's
    streams complete, and the app serves again with a replacement copy on the node left."""
    base = _deploy(cluster, "glm-dp2.yaml", tmp_path, copies=2, max_replicas_per_node=1, name="tiny", dashboard=True)
    try:
        replies = [_replies(base, max_tokens=8, temperature=0) for _ in range(4)]
        assert all(r == replies[0] for r in replies)
        assert httpx.get(f"{base}/health", timeout=30).json()["replicas"] == 2
        copies = _scheduler_nodes(cluster)  # replica id -> node
        assert len(set(copies.values())) == 2, copies
        (victim,) = [node for node in set(copies.values()) if node != "node_head"]
        assert victim not in _other_app_nodes(cluster), "only a Scheduler replica on the node to lose"
        streams, running = _streams_on_both_copies(base, copies)
        cluster.node(victim).stop(signal.SIGKILL)
        ends = [stream.result(timeout=180) for stream in streams]
        lost = [end for end, replica in zip(ends, running) if copies[replica] == victim]
        kept = [end for end, replica in zip(ends, running) if copies[replica] != victim]
        assert lost and kept, running
        assert all(end.done and end.error for end in lost), lost
        assert all(end.done and not end.error and end.finish == "length" for end in kept), kept
        deadline = time.monotonic() + READY_TIMEOUT_S
        while httpx.get(f"{base}/health", timeout=30).json().get("replicas") != 2:
            assert time.monotonic() < deadline, "no replacement copy"
            time.sleep(1)
        assert _replies(base, max_tokens=8, temperature=0) == replies[0]
        assert victim not in _scheduler_nodes(cluster).values()
    finally:
        _shutdown_serve(cluster)


@dataclass
class StreamEnd:
    done: bool = False  # `data: [DONE]` came
    error: str = ""  # the error event's message, if one came
    finish: str = ""  # the last finish_reason


def _stream(base: str, prompt: str, started: threading.Semaphore) -> StreamEnd:
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "stream": True}
    body.update(max_tokens=800, ignore_eos=True, temperature=0)  # still running when the node is lost
    end, first = StreamEnd(), True
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=180) as reply:
        for line in reply.iter_lines():
            if line == "data: [DONE]":
                end.done = True
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    end.error = event["error"].get("message", "error")
                for choice in event.get("choices", ()):
                    end.finish = choice.get("finish_reason") or end.finish
                if first:  # the first event: this stream is running
                    started.release()
                    first = False
    return end


def _streams_on_both_copies(base: str, copies: dict[str, str]) -> tuple[list, list[str]]:
    """Streams until each copy runs at least one; returns them and, per stream, the copy it runs on (from
    /stats: the copy whose running count rose when it started)."""
    pool = ThreadPoolExecutor(8)
    streams: list = []
    running: list[str] = []
    for n in range(8):
        before = _running(base)
        started = threading.Semaphore(0)
        streams.append(pool.submit(_stream, base, f"Tell me a long story, number {n}.", started))
        assert started.acquire(timeout=120)
        after = _running(base)
        (replica,) = [r for r in after if after[r] > before.get(r, 0)]
        running.append(replica)
        if set(running) == set(copies):
            break
    pool.shutdown(wait=False)
    return streams, running


def _running(base: str) -> dict[str, int]:
    stats = httpx.get(f"{base}/stats", timeout=30).json()
    return {r["replica"]: r["running"] for r in stats["replicas"]}


def _live_actors(cluster: LocalCluster) -> list[tuple[str, str]]:
    """(actor name, node name) of every live named actor (the GCS's actor table)."""
    code = (
        "import json\nfrom ray._private.state import actors\n"
        "print(json.dumps([[a.get('Name', ''), a['Address']['NodeID']] for a in actors().values()"
        " if a['State'] == 'ALIVE']))"
    )
    names = alive_nodes(cluster)
    return [(name, names.get(node, "")) for name, node in json.loads(cluster.python(code).strip().splitlines()[-1])]


def _scheduler_nodes(cluster: LocalCluster) -> dict[str, str]:
    """Serve replica id -> node name of every live Scheduler replica (actor `SERVE_REPLICA::app#Scheduler#id`)."""
    return {name.rsplit("#", 1)[1]: node for name, node in _live_actors(cluster) if "#Scheduler#" in name}


def _other_app_nodes(cluster: LocalCluster) -> set[str]:
    """The nodes of the app's other actors: Serve's controller and proxy, Ingress, Renderer, ResponseStore."""
    return {node for name, node in _live_actors(cluster) if name.startswith("SERVE_") and "#Scheduler#" not in name}

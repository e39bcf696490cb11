"""A Ray cluster of three nodes on this machine (`ray start --head`, two `ray start --address` workers with
their own resources), the app deployed onto it with `serve run --address` as an operator would:

- tensor parallel 2 with STRICT_SPREAD: the Scheduler replica and each rank on a node of its own, replies
  equal to tensor parallel 1 (the session's tiny-glm app) token for token;
- data parallel 2, the HTTP front pinned to the head (`front_resources`) and one model copy on each worker
  (`scheduler_resources`, `max_replicas_per_node: 1`), each worker with its own home and so its own
  learn_dir: both copies answer; then the worker of the copy holding a conversation is killed mid-stream:
  its streams end with an error event and [DONE], the other copy's complete, /health counts one copy,
  and the conversation's next turn, on the copy left (whose disk never held it), is the single-node
  server's reply token for token;
- the same over one learn_dir both nodes share (`learn_shared`): the conversation's node stopped, the copy
  left restores its prefix from the folder and replies as the single-node server.
"""

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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
    tmp = tmp_path_factory.mktemp("ray-nodes")
    running = start_cluster(["node_a", "node_b"], tmp, worker_resources={"model_node": 1}, own_homes=True)
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


# The HTTP front on the head, a model copy on each worker (the nodes started with `model_node`).
PLACED = dict(
    name="tiny",
    max_replicas_per_node=1,
    front_resources={"node_head": 0.01},
    scheduler_resources={"model_node": 0.01},
    dashboard=True,  # /stats: which copy answered
    learn_conversations=True,
)
# Several full blocks, so the conversation's state is pieces on disk.
QUESTION = "Describe Kyoto for a first visit: its temples, its gardens, its food, its seasons and its people."


def test_data_parallel_copy_lost_mid_stream(cluster: LocalCluster, glm_base_url: str, tmp_path: Path) -> None:
    """Each worker holds one copy and its own learn_dir (its own home). The worker holding a conversation is
    killed (SIGKILL to its processes, as a crashed machine) while both copies stream."""
    base = _deploy(cluster, "glm-dp2.yaml", tmp_path, copies=2, **PLACED)
    try:
        replies = _replies(base, max_tokens=8, temperature=0)
        assert replies == _replies(glm_base_url, max_tokens=8, temperature=0)
        copies = _scheduler_nodes(cluster)  # replica id -> node
        assert sorted(copies.values()) == ["node_a", "node_b"], copies
        assert _front_nodes(cluster) == {"node_head"}, "the HTTP front and rendering stay on the head"
        first, holder = _first_turn(base, glm_base_url, copies)
        for node in ("node_a", "node_b"):  # each node's store opened its own folder, on its own "disk"
            assert list(Path(cluster.node(node).env["HOME"]).glob(".cache/tensorfold/learned/*-conversations"))
        streams, running = _streams_on_both_copies(base, copies)
        cluster.node(holder).stop(signal.SIGKILL)
        ends = [stream.result(timeout=180) for stream in streams]
        lost = [end for end, replica in zip(ends, running) if copies[replica] == holder]
        kept = [end for end, replica in zip(ends, running) if copies[replica] != holder]
        assert lost and kept, running
        assert all(end.done and end.error for end in lost), lost
        assert all(end.done and not end.error and end.finish == "length" for end in kept), kept
        _wait_for_copies(base, 1)  # the copy left; Serve's replacement has no node (one copy per model node)
        resume = _imprint(base, first)
        assert resume["disk_tokens"] == 0 and resume["resume_from"] != "disk", resume  # its own disk never held it
        assert _next_turn(base, first) == _next_turn(glm_base_url, first)
        assert _replies(base, max_tokens=8, temperature=0) == replies  # every new request answered
        assert set(_scheduler_nodes(cluster).values()) == {"node_a", "node_b"} - {holder}
    finally:
        _shutdown_serve(cluster)
        _restart_stopped(cluster)


def test_a_conversation_resumes_from_a_shared_folder_on_the_other_node(
    cluster: LocalCluster, glm_base_url: str, tmp_path: Path
) -> None:
    """Both nodes' stores in one folder (shared storage): the conversation's node stopped, the copy left reads
    its prefix from the folder, and its next turn is the single-node server's."""
    shared = dict(PLACED, learn_dir=str(tmp_path / "shared-store"), learn_shared=True)
    base = _deploy(cluster, "glm-dp2.yaml", tmp_path, copies=2, **shared)
    try:
        copies = _scheduler_nodes(cluster)
        assert sorted(copies.values()) == ["node_a", "node_b"], copies
        first, holder = _first_turn(base, glm_base_url, copies)
        _wait_for(lambda: _imprint(base, first)["disk_tokens"] > 0, "the conversation's state on disk")
        _wait_for(lambda: _store(base).get("pieces_written", 0) > 0, "the store to write its pieces")
        cluster.node(holder).stop()
        _wait_for_copies(base, 1)
        resume = _imprint(base, first)
        assert resume["resume_from"] == "disk" and resume["disk_tokens"] > 0, resume
        assert _next_turn(base, first) == _next_turn(glm_base_url, first)
        assert _store(base)["restored_tokens"] >= resume["disk_tokens"]
    finally:
        _shutdown_serve(cluster)  # the module's last test: the stopped node stays stopped


def _restart_stopped(cluster: LocalCluster) -> None:
    for node in cluster.nodes:
        if node.process.poll() is not None:
            cluster.restart(node.name)


def _wait_for(check, what: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.5)


def _wait_for_copies(base: str, copies: int) -> None:
    """Until /health counts `copies` Scheduler replicas answering."""
    _wait_for(lambda: httpx.get(f"{base}/health", timeout=30).json().get("replicas") == copies, f"{copies} copies")


def _store(base: str) -> dict:
    return httpx.get(f"{base}/health", timeout=30).json()["store"]


def _first_turn(base: str, reference: str, copies: dict[str, str]) -> tuple[list[dict], str]:
    """The conversation's first turn (the single-node server's reply), and the node of the copy that ran it."""
    before = _served(base)
    messages = [{"role": "user", "content": QUESTION}]
    reply = _chat(base, messages)
    assert reply == _chat(reference, messages)
    after = _served(base)
    (replica,) = [r for r in after if after[r] > before.get(r, 0)]
    return [*messages, {"role": "assistant", "content": reply}], copies[replica]


def _next_turn(base: str, conversation: list[dict]) -> str:
    return _chat(base, [*conversation, {"role": "user", "content": "And what should I eat there?"}])


def _chat(base: str, messages: list[dict]) -> str:
    body = {"model": "tiny", "messages": messages, "max_tokens": 24, "temperature": 0}
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=180)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def _imprint(base: str, conversation: list[dict]) -> dict:
    """Where the conversation's next turn would resume, from the copy it would be routed to."""
    body = {"model": "tiny", "messages": [*conversation, {"role": "user", "content": "And what should I eat there?"}]}
    answer = httpx.post(f"{base}/v1/imprint/resume", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _served(base: str) -> dict[str, int]:
    stats = httpx.get(f"{base}/stats", timeout=30).json()
    return {r["replica"]: r["requests_total"] for r in stats["replicas"]}


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


def _streams_on_both_copies(base: str, copies: dict[str, str]) -> tuple[list[Future], list[str]]:
    """Streams until each copy runs at least one; returns them and, per stream, the copy it runs on (from
    /stats: the copy whose running count rose when it started)."""
    pool = ThreadPoolExecutor(8)
    streams: list[Future] = []
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


def _front_nodes(cluster: LocalCluster) -> set[str]:
    """The nodes of the app's actors besides the model copies: Serve's controller and proxy, Ingress,
    Renderer, ResponseStore."""
    return {node for name, node in _live_actors(cluster) if name.startswith("SERVE_") and "#Scheduler#" not in name}

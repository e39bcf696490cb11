"""A Ray cluster of three nodes on this machine (`ray start --head`, two `ray start --address` workers with
their own resources), the app deployed onto it with `serve run --address` as an operator would:

- tensor parallel 2 with STRICT_SPREAD: the Scheduler replica and each rank on a node of its own, replies
  equal to tensor parallel 1 (the session's tiny-glm app) token for token;
- data parallel 2 with `max_replicas_per_node: 1`: the two model copies on different nodes, both answering.
"""

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
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
    running = start_cluster(["node_a", "node_b"], tmp_path_factory.mktemp("ray-nodes"))
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


def test_data_parallel_copies_on_different_nodes_both_answer(cluster: LocalCluster, tmp_path: Path) -> None:
    base = _deploy(cluster, "glm-dp2.yaml", tmp_path, copies=2, max_replicas_per_node=1, name="tiny")
    try:
        replies = [_replies(base, max_tokens=8, temperature=0) for _ in range(4)]
        assert all(r == replies[0] for r in replies)
        assert httpx.get(f"{base}/health", timeout=30).json()["replicas"] == 2
        copies = _scheduler_nodes(cluster)  # replica id -> node
        assert len(copies) == 2 and len(set(copies.values())) == 2, copies
    finally:
        _shutdown_serve(cluster)


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

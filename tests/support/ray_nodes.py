"""A Ray cluster of several nodes on this machine, started as an operator does: `ray start --head`, then
`ray start --address` for each worker, each node with a custom resource naming it (`node_a: 1`), with
Ray's token authentication on (Ray binds a node given 127.0.0.1 to the machine's own address). Each worker
may get further resources (a label such as `model_node: 1`) and a home folder of its own, so that a path
under `~` (the default learn_dir) is each node's own, as on separate machines.

Every node runs `ray start --block` in its own process group, so stopping one node (SIGTERM to its group)
takes down exactly its raylet and workers: never `ray stop`, which would stop every Ray on the machine.
"""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kernels import cpu_native
from serve_app.ray_network import LOCAL_RAY_VARIABLE
from tests.conftest import REPO, free_port

NODE_START_TIMEOUT_S = 120


@dataclass
class LocalNode:
    name: str  # its custom resource: `node_head`, `node_a`, ...
    process: subprocess.Popen
    log: Path
    folder: Path  # its own --temp-dir: session, sockets and logs
    args: list[str]  # its `ray start` arguments, less the folder and ports: what a restart starts again
    env: dict[str, str]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, sig)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass
class LocalCluster:
    gcs_address: str  # `127.0.0.1:PORT`: what `serve run --address` and `ray start --address` take
    env: dict[str, str]  # the environment every command against it runs with
    nodes: list[LocalNode] = field(default_factory=list)

    def node(self, name: str) -> LocalNode:
        (node,) = [n for n in self.nodes if n.name == name]
        return node

    def restart(self, name: str) -> None:
        """Start a stopped node again under its name and resources (new folder and ports), once it is alive."""
        old = self.node(name)
        assert old.process.poll() is not None, f"{name} is still running"
        self.nodes[self.nodes.index(old)] = _start_node(name, old.args, old.env, old.log.parent)
        _wait_for_nodes(self, len(self.nodes))

    def python(self, code: str, timeout: float = 120) -> str:
        """Run `code` in a driver connected to this cluster; returns its stdout."""
        script = f"import ray\nray.init(address={self.gcs_address!r}, log_to_driver=False)\n{code}"
        result = subprocess.run(
            [sys.executable, "-c", script], env=self.env, capture_output=True, text=True, timeout=timeout, cwd=REPO
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    def stop(self) -> None:
        for node in reversed(self.nodes):  # workers first, the head (GCS) last
            node.stop()
        _forget_cluster(self.gcs_address)


def _forget_cluster(gcs_address: str) -> None:
    """`ray start --head` names its cluster in /tmp/ray/ray_current_cluster, where a later `ray.init()`
    without an address would try to join it: remove the name once the cluster is gone."""
    current = Path("/tmp/ray/ray_current_cluster")
    try:
        if current.read_text().strip().rsplit(":", 1)[-1] == gcs_address.rsplit(":", 1)[-1]:
            current.unlink()
    except OSError:
        pass


def _ray_start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    command = [str(Path(sys.executable).parent / "ray"), "start", "--block", "--disable-usage-stats", *args]
    with open(log, "w") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _start_node(name: str, args: list[str], env: dict[str, str], tmp: Path) -> LocalNode:
    """One node with folders and agent ports of its own: nodes of one machine would otherwise share the
    raylet's socket file and the agents' fixed ports."""
    folder = Path(tempfile.mkdtemp(prefix=f"tfray-{name}-", dir="/tmp"))  # socket paths must stay short
    ports = {
        flag: free_port()
        for flag in (
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "metrics-export-port",
            "runtime-env-agent-port",
        )
    }
    started = [*args, f"--temp-dir={folder}", *(f"--{flag}={port}" for flag, port in ports.items())]
    log = tmp / f"{name}.log"
    return LocalNode(name, _ray_start(started, env, log), log, folder, args, env)


def start_cluster(
    workers: list[str],
    tmp: Path,
    cpus_per_node: int = 2,
    token_auth: bool = True,
    worker_resources: dict[str, float] | None = None,
    own_homes: bool = False,
) -> LocalCluster:
    """A head (`node_head`) and one worker node per name on this machine's address; waits until every node is
    alive. `token_auth=False` makes the unauthenticated cluster the startup check must refuse;
    `worker_resources` are added to every worker's; `own_homes` gives each worker its own HOME under `tmp`."""
    # Several nodes: not the single-machine Ray the rest of the tests keep on loopback (serve_app/ray_network.py).
    dropped = ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", LOCAL_RAY_VARIABLE)
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    # Token authentication on, as the docs ask of any cluster whose ports leave loopback.
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)} if token_auth else {}
    env.update({"RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO), **auth})
    port = free_port()
    cluster = LocalCluster(f"127.0.0.1:{port}", env)
    common = ["--node-ip-address=127.0.0.1", "--num-gpus=0"]
    head_args = [*common, f"--num-cpus={cpus_per_node}", "--head", f"--port={port}"]
    head_args += ["--include-dashboard=false", '--resources={"node_head": 1}']
    cluster.nodes.append(_start_node("node_head", head_args, env, tmp))
    try:
        _wait_for_nodes(cluster, 1)
        for name in workers:
            args = [*common, f"--num-cpus={cpus_per_node}", f"--address={cluster.gcs_address}"]
            args.append(f"--resources={json.dumps({name: 1, **(worker_resources or {})})}")
            node_env = {**env, **_own_home(tmp, name)} if own_homes else env
            cluster.nodes.append(_start_node(name, args, node_env, tmp))
        _wait_for_nodes(cluster, 1 + len(workers))
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _own_home(tmp: Path, name: str) -> dict[str, str]:
    """A node's own HOME, and the machine's compiled CPU kernels kept (a fresh cache would compile them
    again on every node, minutes on a 2-core machine)."""
    home = tmp / f"home-{name}"
    home.mkdir(exist_ok=True)
    return {"HOME": str(home), "TENSORFOLD_KERNEL_CACHE": str(cpu_native.cache_dir())}


def alive_nodes(cluster: LocalCluster) -> dict[str, str]:
    """Node id -> the custom resource naming it, for every node the GCS counts alive."""
    code = (
        "import json\n"
        "nodes = {n['NodeID']: next((r for r in n['Resources'] if r.startswith('node_')), '')"
        " for n in ray.nodes() if n['Alive']}\n"
        "print(json.dumps(nodes))"
    )
    return json.loads(cluster.python(code).strip().splitlines()[-1])


def _wait_for_nodes(cluster: LocalCluster, count: int) -> None:
    deadline = time.monotonic() + NODE_START_TIMEOUT_S
    while True:
        for node in cluster.nodes:
            assert node.process.poll() is None, node.log.read_text()[-3000:]
        try:
            if len(alive_nodes(cluster)) >= count:
                return
        except AssertionError:
            pass  # the GCS is not up yet
        assert time.monotonic() < deadline, f"{count} nodes not alive after {NODE_START_TIMEOUT_S} s"
        time.sleep(1)

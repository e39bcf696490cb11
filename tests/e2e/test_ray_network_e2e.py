"""The startup check against real Rays whose ports are on the machine's address, token authentication off:
joining such a cluster (`ray start --head`, then the app builder's driver) is refused in one line and the
setting lets it start with a WARNING; a single-machine Ray the command started itself (plain `serve run`)
starts with a WARNING naming the safe command. Subprocesses, so each Ray is its own and not the session's
loopback one (tests/conftest.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from serve_app.ray_network import LOCAL_RAY_VARIABLE
from tests.conftest import REPO
from tests.support.ray_nodes import start_cluster

pytestmark = pytest.mark.e2e
CHECKS = """
import logging, sys
from serve_app.ray_network import RayNetworkError, check_ray_network, exposed_hosts, read_exposure
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s", stream=sys.stdout)
print("EXPOSED", exposed_hosts(read_exposure()), flush=True)
try:
    check_ray_network(allowed=False)
    print("STARTED", flush=True)
except RayNetworkError as exc:
    print("REFUSED", exc, flush=True)
check_ray_network(allowed=True)
"""


def _machine_address() -> str | None:
    """The address Ray would give a node that others may join, or None on a machine with loopback only."""
    from ray._common.network_utils import node_ip_address_from_perspective

    address = node_ip_address_from_perspective(None)
    return None if address.startswith("127.") or address == "::1" else address


@pytest.fixture()
def address() -> str:
    found = _machine_address()
    if found is None:
        pytest.skip("this machine has no address beyond loopback for Ray to bind")
    return found


def test_joining_an_unauthenticated_cluster_beyond_loopback_is_refused_unless_allowed(
    address: str, tmp_path: Path
) -> None:
    cluster = start_cluster([], tmp_path, cpus_per_node=1, token_auth=False)
    try:
        lines = cluster.python(CHECKS).splitlines()
    finally:
        cluster.stop()
    assert f"EXPOSED ['{address}']" in lines
    (refused,) = [line for line in lines if line.startswith("REFUSED ")]
    assert f"Ray listens on {address}:" in refused and "RAY_AUTH_MODE=token" in refused
    warnings = [line for line in lines if "allow_unauthenticated_ray_network is set" in line]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING "), lines


def test_a_single_machine_ray_started_here_beyond_loopback_starts_with_a_warning(address: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", LOCAL_RAY_VARIABLE)}
    env.update(RAY_AUTH_MODE="disabled", PYTHONPATH=str(REPO))
    script = (
        "import ray\nray.init(address='local', num_cpus=1, include_dashboard=False, log_to_driver=False)\n"
        f"try:\n{_indented(CHECKS)}\nfinally:\n    ray.shutdown()\n"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stderr[-3000:]
    assert "STARTED" in lines and not any(line.startswith("REFUSED") for line in lines)
    (warned,) = [line for line in lines if line.startswith("WARNING Ray's token authentication is off")]
    assert f"Ray listens on {address}:" in warned and f"{LOCAL_RAY_VARIABLE}=0 serve run" in warned
    assert warned.endswith("so it starts anyway.")


def _indented(code: str) -> str:
    return "\n".join("    " + line for line in code.strip().splitlines())

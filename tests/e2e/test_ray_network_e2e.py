"""The startup check against a real Ray that other nodes could join (its ports on the machine's address),
token authentication off: the app builder's check refuses in one line, and the setting lets it start with
a WARNING. A subprocess, so its Ray is its own and not the session's loopback one (tests/conftest.py)."""

import os
import subprocess
import sys

import pytest

from serve_app.ray_network import LOCAL_RAY_VARIABLE
from tests.conftest import REPO

pytestmark = pytest.mark.e2e
SCRIPT = """
import logging, ray
from serve_app.ray_network import RayNetworkError, check_ray_network, exposed_hosts, read_exposure
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
try:
    print("EXPOSED", exposed_hosts(read_exposure()), flush=True)
    try:
        check_ray_network(allowed=False)
    except RayNetworkError as exc:
        print("REFUSED", exc, flush=True)
    check_ray_network(allowed=True)
finally:
    ray.shutdown()
"""


def _machine_address() -> str | None:
    """The address Ray would give a node that others may join, or None on a machine with loopback only."""
    from ray._common.network_utils import node_ip_address_from_perspective

    address = node_ip_address_from_perspective(None)
    return None if address.startswith("127.") or address == "::1" else address


def test_an_unauthenticated_ray_beyond_loopback_is_refused_unless_allowed() -> None:
    address = _machine_address()
    if address is None:
        pytest.skip("this machine has no address beyond loopback for Ray to bind")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", LOCAL_RAY_VARIABLE)}
    env.update(RAY_AUTH_MODE="disabled", PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = run.stdout.splitlines() + run.stderr.splitlines()
    assert run.returncode == 0, "\n".join(lines[-30:])
    assert f"EXPOSED ['{address}']" in lines
    (refused,) = [line for line in lines if line.startswith("REFUSED ")]
    assert f"Ray listens on {address}:" in refused and "RAY_AUTH_MODE=token" in refused
    warnings = [line for line in lines if "allow_unauthenticated_ray_network is set" in line]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING "), lines

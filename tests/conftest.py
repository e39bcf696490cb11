"""Shared fixtures: checkpoints made offline, one Ray cluster for the whole run, Serve apps from configs.

Ray is started once per session (`ray.init(num_cpus=8)`: logical CPUs, so fractional deployments from
several apps fit even on a 2-core machine) and Serve once on a free port; each e2e module deploys the
applications it needs from the repo's Serve config YAMLs and waits for them to report RUNNING.
"""

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve_app.ray_network import local_ray_env

REPO = Path(__file__).resolve().parents[1]
BUILTIN_TINY_GLM = REPO / "serve_app" / "builtin" / "tiny-glm"

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# The session's Ray, started unauthenticated, keeps every port on 127.0.0.1 (the app builder refuses
# otherwise: serve_app/ray_network.py); Ray reads this on import, after this file runs.
os.environ.update(local_ray_env())
# Ray's workers and Serve's build task import this checkout (also when it is not pip-installed).
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def build_glm_checkpoint(out_dir: Path, *, seed: int = 0, corpus: list[str] | None = None) -> Path:
    """A random glm4_moe checkpoint with the GLM tokenizer and tiny-glm's chat template.

    `seed` picks the weights; `corpus` adds tokenizer training text (to make chosen words single tokens).
    """
    from serve_app.fixtures.checkpoints import build_random_checkpoint
    from serve_app.fixtures.tokenizer_builder import build_tokenizer

    build_tokenizer(out_dir, vocab_size=512, family="glm", corpus=corpus)
    build_random_checkpoint("glm4_moe", out_dir, vocab_size=512, seed=seed)
    template = REPO / "serve_app" / "fixtures" / "tiny_glm" / "chat_template.jinja"
    (out_dir / "chat_template.jinja").write_text(template.read_text(encoding="utf-8"), encoding="utf-8")
    return out_dir


def end_token_checkpoint(out_dir: Path) -> Path:
    """A random GLM checkpoint whose end token is the tokenizer's."""
    from serve_app.fixtures.tokenizer_builder import use_tokenizer_end_token

    return use_tokenizer_end_token(build_glm_checkpoint(out_dir))


@pytest.fixture(scope="session")
def random_glm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_glm_checkpoint(tmp_path_factory.mktemp("random-glm"))


@pytest.fixture(scope="session")
def served_model() -> str:
    """What the e2e graph serves: the committed, trained tiny-glm, which writes its scripted replies."""
    assert (BUILTIN_TINY_GLM / "config.json").exists(), "serve_app/builtin/tiny-glm is part of the repository"
    return "builtin:tiny-glm"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    import ray

    from serve_app.serve_env import cluster_runtime_env

    # Serve's data-path settings reach its controller and proxy from the job; the apps are reached through
    # Serve's proxy, as under `serve run` (tests/e2e/test_cli_serve_e2e.py runs `tensorfold serve`'s direct path).
    ray.init(
        address="local",  # its own, never one a `ray start` on this machine recorded
        num_cpus=8,
        namespace="serve",
        include_dashboard=False,
        log_to_driver=False,
        runtime_env=cluster_runtime_env(),
    )
    yield
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_url(ray_cluster: None) -> str:
    """Serve's HTTP proxy on a free port; returns its base URL."""
    from ray.serve._private.api import serve_start

    port = free_port()
    serve_start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


GLM_APP = "e2e-glm"


@pytest.fixture(scope="session")
def glm_base_url(serve_url: str, served_model: str) -> Iterator[str]:
    """configs/glm.yaml serving tiny-glm (aliases `glm`), deployed once for every module that uses it."""
    from tests.support.serve_harness import delete_apps, deploy_apps, load_app_config

    deploy_apps([load_app_config("glm.yaml", GLM_APP, "/glm", model=served_model, name="tiny", aliases=["glm"])])
    yield f"{serve_url}/glm"
    delete_apps([GLM_APP])

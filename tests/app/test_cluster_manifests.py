"""The cluster manifests are what Ray and KubeRay accept: cluster/cluster.yaml against Ray's cluster-config
schema (Ray's own validator), cluster/rayservice.yaml against KubeRay's RayService CRD schema (a pinned copy
in tests/data) with its Serve application parsed by Serve's config model and our app's arguments, and every
image and version they name matching pyproject.toml."""

import gzip
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from serve_app.args import AppArgs

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster"
RAYSERVICE_SCHEMA = ROOT / "tests" / "data" / "kuberay-rayservice-v1.7.0.schema.json.gz"


def _project() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _pinned(package: str) -> str:
    (spec,) = [d for d in _project()["dependencies"] if re.match(rf"{re.escape(package)}(\[.*\])?==", d)]
    return spec.split("==", 1)[1]


def _python_tag() -> str:
    """`py311` from requires-python `>=3.11,<3.12`."""
    low = re.search(r">=\s*3\.(\d+)", _project()["requires-python"]).group(1)
    return f"py3{low}"


def _strict(schema: Any) -> Any:
    """The schema as `kubectl apply --validate=strict` reads it: an unknown field is an error, not pruned."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {k: _strict(v) for k, v in schema.items()}
    open_ended = "additionalProperties" in schema or schema.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in schema and not open_ended:
        strict["additionalProperties"] = False
    return strict


def _rayservice_validator() -> jsonschema.Draft7Validator:
    schema = json.loads(gzip.decompress(RAYSERVICE_SCHEMA.read_bytes()))["openAPIV3Schema"]
    return jsonschema.Draft7Validator(_strict(schema))


def test_cluster_config_passes_rays_own_validation() -> None:
    validate_config(prepare_config(yaml.safe_load((CLUSTER / "cluster.yaml").read_text())))


def test_cluster_config_validation_catches_a_misspelled_field() -> None:
    config = yaml.safe_load((CLUSTER / "cluster.yaml").read_text())
    config["available_node_types"]["gpu_worker"]["min_worker"] = 1
    with pytest.raises(jsonschema.ValidationError, match="min_worker"):
        validate_config(prepare_config(config))


def test_cluster_nodes_run_the_pinned_ray_with_token_auth_and_a_loopback_dashboard() -> None:
    config = yaml.safe_load((CLUSTER / "cluster.yaml").read_text())
    assert config["docker"]["image"] == f"rayproject/ray:{_pinned('ray')}-{_python_tag()}-gpu"
    head, worker = config["head_start_ray_commands"][-1], config["worker_start_ray_commands"][-1]
    for command in (head, worker):
        assert "RAY_AUTH_MODE=token" in command and "RAY_AUTH_TOKEN_PATH=" in command
    assert "--dashboard-host=127.0.0.1" in head


def test_rayservice_matches_kuberays_schema() -> None:
    manifest = yaml.safe_load((CLUSTER / "rayservice.yaml").read_text())
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in _rayservice_validator().iter_errors(manifest)]
    assert errors == []


def test_rayservice_schema_check_catches_a_misplaced_field() -> None:
    manifest = yaml.safe_load((CLUSTER / "rayservice.yaml").read_text())
    manifest["spec"]["rayClusterConfig"]["authOptions"]["mode"] = "tokens"
    manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "one"
    manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    errors = " | ".join(sorted(e.message for e in _rayservice_validator().iter_errors(manifest)))
    assert errors.count(" | ") == 2, errors
    for wrong in ("'tokens' is not one of", "'one' is not of type", "('rayStartParam' was unexpected)"):
        assert wrong in errors


def test_rayservice_application_is_a_serve_config_with_valid_app_args(tmp_path: Path) -> None:
    manifest = yaml.safe_load((CLUSTER / "rayservice.yaml").read_text())
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load(manifest["spec"]["serveConfigV2"]))
    (app,) = serve_config.applications
    assert app.import_path == "serve_app.app:build_app"
    (tmp_path / "config.json").write_text("{}")  # the model path exists in the pod; any folder stands for it
    AppArgs.model_validate({**app.args, "model": str(tmp_path)})


def test_rayservice_runs_the_pinned_ray_and_the_projects_image() -> None:
    manifest = yaml.safe_load((CLUSTER / "rayservice.yaml").read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == _pinned("ray")
    assert cluster["authOptions"]["mode"] == "token"
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    images = {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}
    assert images == {f"tensorfold:{_project()['version']}"}
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    assert f"FROM rayproject/ray:{_pinned('ray')}-{_python_tag()}-gpu" in dockerfile
    assert f"-t tensorfold:{_project()['version']}" in dockerfile

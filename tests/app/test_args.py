"""AppArgs, the CLI's mapping onto it, the Serve configs and the graph options build_app derives."""

import socket
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from serve_app.app import STORE_STOP_S, actor_options, placement_bundles, scheduler_options, stop_options
from serve_app.args import AppArgs
from serve_app.cli import build_parser
from serve_app.cli_serve import app_args_from
from serve_app.serve_env import REPLICA_DEFAULTS, cluster_runtime_env, replica_env

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    directory = tmp_path / "my-model"
    directory.mkdir()
    return directory


def test_unknown_key_is_an_error_naming_it(ckpt: Path) -> None:
    with pytest.raises(ValidationError) as info:
        AppArgs(model=str(ckpt), tensor_paralel_size=2)
    assert "tensor_paralel_size" in str(info.value)


def test_missing_checkpoint_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ValidationError) as info:
        AppArgs(model=str(tmp_path / "nowhere"))
    assert "nowhere" in str(info.value)


def test_unknown_builtin_is_refused() -> None:
    with pytest.raises(ValidationError, match="unknown builtin"):
        AppArgs(model="builtin:does-not-exist")


def test_names_default_to_the_directory_and_aliases_follow(ckpt: Path) -> None:
    args = AppArgs(model=str(ckpt), aliases=["a", "my-model", "b", "a"])
    assert args.served_name == "my-model"
    assert args.model_ids == ["my-model", "a", "b"]
    named = AppArgs(model=str(ckpt), name="served", aliases=["x"])
    assert named.model_ids == ["served", "x"]


def test_engine_config_carries_the_engine_knobs(ckpt: Path) -> None:
    args = AppArgs(
        model=str(ckpt),
        context=512,
        parallel=4,
        dtype="float32",
        decode_share=0.5,
        prompt_cache_gib=0,
        tensor_parallel_size=2,
        default_max_tokens=64,
    )
    config = args.engine_config()
    assert config.model == str(ckpt.resolve())
    assert (config.context, config.parallel, config.dtype) == (512, 4, "float32")
    assert (config.decode_share, config.prompt_cache_gib, config.tensor_parallel_size) == (0.5, 0, 2)
    assert config.default_max_tokens == 64


@pytest.mark.parametrize(
    "bad",
    [
        {"parallel": 0},
        {"decode_share": 1.5},
        {"port": 0},
        {"placement_strategy": "SPREADING"},
        {"aliases": [""]},
        {"ready_wait_s": -1},
        {"front_resources": {"CPU": 1}},
        {"scheduler_resources": {"model_node": 0}},
        {"rank_resources": {"GPU": 1}},
    ],
)
def test_bad_values_are_refused(ckpt: Path, bad: dict) -> None:
    with pytest.raises(ValidationError):
        AppArgs(model=str(ckpt), **bad)


def test_cli_flags_build_the_same_args(ckpt: Path) -> None:
    argv = [
        "serve",
        str(ckpt),
        "--host",
        "0.0.0.0",
        "--port",
        "9000",
        "--name",
        "m",
        "--alias",
        "a1",
        "--alias",
        "a2",
        "--context",
        "256",
        "--parallel",
        "auto",
        "--dtype",
        "bfloat16",
        "--tensor-parallel-size",
        "2",
        "--data-parallel-size",
        "3",
        "--prompt-cache-gib",
        "1.5",
        "--decode-share",
        "0.1",
        "--ready-wait",
        "7.5",
        "--router",
        "serve",
    ]
    args = app_args_from(build_parser().parse_args(argv))
    assert args == AppArgs(
        model=str(ckpt),
        host="0.0.0.0",
        port=9000,
        name="m",
        aliases=["a1", "a2"],
        context=256,
        parallel="auto",
        dtype="bfloat16",
        tensor_parallel_size=2,
        data_parallel_size=3,
        prompt_cache_gib=1.5,
        decode_share=0.1,
        ready_wait_s=7.5,
        router="serve",
    )
    assert app_args_from(build_parser().parse_args(["serve", str(ckpt), "--parallel", "4"])).parallel == 4


def test_cli_without_flags_keeps_the_defaults(ckpt: Path) -> None:
    assert app_args_from(build_parser().parse_args(["serve", str(ckpt)])) == AppArgs(model=str(ckpt))


@pytest.mark.parametrize("name", ["glm.yaml", "glm-tp2.yaml", "glm-dp2.yaml"])
def test_configs_are_valid_serve_configs_with_valid_args(name: str, ckpt: Path) -> None:
    config = yaml.safe_load((CONFIGS / name).read_text())
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    if app.args.get("http_entry") == "ingress":  # the Ingress replica answers 8080; Serve's proxy takes a free port
        env = config["controller_options"]["runtime_env"]["env_vars"]
        assert schema.http_options.port == 0 and env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
        assert int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]) == app.args["port"] == 8080
    else:
        assert schema.http_options.port == 8080
    assert schema.http_options.host == "127.0.0.1"
    assert app.import_path == "serve_app.app:build_app"
    assert app.args["model"] == "builtin:tiny-glm"
    args = AppArgs.model_validate({**app.args, "model": str(ckpt)})
    assert max(args.ingress_cpus, args.renderer_cpus, args.scheduler_cpus) < 1, "must fit a 2-core machine"
    for deployment in app.deployments:  # an actor-options override would drop Serve's data-path settings
        assert "ray_actor_options" not in deployment.model_dump(exclude_unset=True)


def test_every_replica_gets_serve_data_path_settings(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in REPLICA_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    assert actor_options(0.1) == {"num_cpus": 0.1, "runtime_env": {"env_vars": REPLICA_DEFAULTS}}
    for args in (AppArgs(model=str(ckpt)), AppArgs(model=str(ckpt), tensor_parallel_size=2)):
        env = scheduler_options(args, "cpu")["ray_actor_options"]["runtime_env"]["env_vars"]
        assert REPLICA_DEFAULTS.items() <= env.items()


def test_an_operator_setting_wins_over_the_data_path_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_SERVE_PROXY_USE_GRPC", raising=False)
    assert cluster_runtime_env()["env_vars"]["RAY_SERVE_PROXY_USE_GRPC"] == "1"
    monkeypatch.setenv("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "1")
    monkeypatch.setenv("RAY_SERVE_PROXY_USE_GRPC", "0")
    assert replica_env()["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "1"
    assert cluster_runtime_env()["env_vars"]["RAY_SERVE_PROXY_USE_GRPC"] == "0"


def test_direct_ingress_gives_the_controller_exactly_the_users_port(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS" not in cluster_runtime_env()["env_vars"]  # the proxy path
    env = cluster_runtime_env(9123)["env_vars"]
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    # Serve allocates from range(MIN, MAX): the one port asked for, and no other.
    low, high = env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]
    assert range(int(low), int(high)) == range(9123, 9124)


def test_tensor_parallel_gets_one_bundle_per_rank(ckpt: Path) -> None:
    args = AppArgs(model=str(ckpt), tensor_parallel_size=2, scheduler_cpus=0.2, rank_cpus=0.3)
    assert placement_bundles(args, "cpu") == [{"CPU": 0.2}, {"CPU": 0.3}, {"CPU": 0.3}]
    assert placement_bundles(args, "cuda") == [{"CPU": 0.2}, {"CPU": 0.3, "GPU": 1}, {"CPU": 0.3, "GPU": 1}]
    options = scheduler_options(args, "cpu")
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["ray_actor_options"]["num_cpus"] == 0.2
    assert options["ray_actor_options"]["runtime_env"]["env_vars"]["TENSORFOLD_RANK_CPUS"] == "0.3"
    assert sum(b["CPU"] for b in options["placement_group_bundles"]) < 2


def test_a_planned_stop_fits_thirty_seconds_and_serve_waits_for_each_step(ckpt: Path) -> None:
    args = AppArgs(model=str(ckpt))
    scheduler = scheduler_options(args, "cpu")["graceful_shutdown_timeout_s"]
    assert args.drain_grace_s + STORE_STOP_S <= scheduler <= 30.0  # the grace, the store's last writes, a margin
    assert stop_options(args)["graceful_shutdown_timeout_s"] > args.drain_grace_s  # Ingress outlives the grace
    longer = AppArgs(model=str(ckpt), drain_grace_s=40)
    assert scheduler_options(longer, "cpu")["graceful_shutdown_timeout_s"] == scheduler + 32
    assert app_args_from(build_parser().parse_args(["serve", str(ckpt), "--drain-timeout", "3"])).drain_grace_s == 3


def test_custom_resources_place_the_front_and_the_model_copies() -> None:
    """front_resources reach the Ingress, Renderer and ResponseStore; scheduler_resources each model copy
    (bundle 0 of its placement group at tensor parallel > 1, which the replica runs in)."""
    from serve_app.app import build_graph

    args = AppArgs(front_resources={"node_head": 0.01}, scheduler_resources={"model_node": 0.5}, data_parallel_size=2)
    ingress = build_graph(args)._bound_deployment
    graph = [ingress] + [a._bound_deployment for a in ingress.init_args if hasattr(a, "_bound_deployment")]
    placed = {d.name: d.ray_actor_options.get("resources") for d in graph}
    front = {"node_head": 0.01}
    assert placed == {"Ingress": front, "Renderer": front, "Scheduler": {"model_node": 0.5}, "ResponseStore": front}
    spread = args.model_copy(update={"tensor_parallel_size": 2})
    assert placement_bundles(spread, "cpu")[0] == {"CPU": 0.2, "model_node": 0.5}
    assert "resources" not in scheduler_options(AppArgs(), "cpu")["ray_actor_options"]  # unset: Ray places them


def test_data_parallel_is_scheduler_replicas(ckpt: Path) -> None:
    options = scheduler_options(AppArgs(model=str(ckpt), data_parallel_size=2), "cpu")
    assert options["num_replicas"] == 2
    assert "placement_group_bundles" not in options
    gpu = scheduler_options(AppArgs(model=str(ckpt)), "cuda")
    assert gpu["ray_actor_options"]["num_gpus"] == 1


def test_data_parallel_routes_by_prefix_affinity_by_default(ckpt: Path) -> None:
    from deployments.routing.request_router import PrefixAffinityRouter

    options = scheduler_options(
        AppArgs(model=str(ckpt), data_parallel_size=2, block_size=32, routing_balance_abs=9), "cpu"
    )
    config = options["request_router_config"]
    assert config.request_router_class == f"{PrefixAffinityRouter.__module__}.{PrefixAffinityRouter.__name__}"
    assert config.request_router_kwargs["block_size"] == 32 and config.request_router_kwargs["balance_abs"] == 9
    assert config.request_routing_stats_period_s == 1.0
    assert "request_router_config" not in scheduler_options(AppArgs(model=str(ckpt)), "cpu")  # one copy
    serve_router = AppArgs(model=str(ckpt), data_parallel_size=2, router="serve")
    assert "request_router_config" not in scheduler_options(serve_router, "cpu")
    assert AppArgs(model=str(ckpt), router="affinity").affinity_routing


def test_serve_refuses_a_taken_port_before_starting_ray(capsys: pytest.CaptureFixture[str]) -> None:
    import ray

    from serve_app.cli import main as cli_main

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        was_initialized = ray.is_initialized()
        assert cli_main(["serve", "builtin:tiny-glm", "--port", str(port)]) == 2
        assert ray.is_initialized() == was_initialized
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"model_type": "gpt_bigcode"}, "model_type 'gpt_bigcode' is not supported (supported: llama, qwen3"),
        ("builtin", "no model.safetensors or model.safetensors.index.json"),  # the config, not the weights
    ],
)
def test_serve_refuses_a_checkpoint_it_cannot_serve_before_starting_ray(
    ckpt: Path, config: dict | str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    import ray

    from serve_app.app import build_app
    from serve_app.cli import main as cli_main

    builtin = Path(__file__).parents[2] / "serve_app" / "builtin" / "tiny-glm" / "config.json"
    (ckpt / "config.json").write_text(builtin.read_text() if config == "builtin" else json.dumps(config))
    was_initialized = ray.is_initialized()
    assert cli_main(["serve", str(ckpt)]) == 2
    assert ray.is_initialized() == was_initialized
    err = capsys.readouterr().err
    assert err.startswith("tensorfold serve: ") and expected in err and err.count("\n") == 1
    with pytest.raises(ValueError, match="not supported|no model.safetensors"):  # `serve run` builds the same way
        build_app(AppArgs(model=str(ckpt)))


def test_serve_refuses_a_gguf_architecture_it_does_not_serve_in_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import gguf
    import numpy as np
    import ray

    from serve_app.cli import main as cli_main

    monkeypatch.setenv("TENSORFOLD_GGUF_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    was_initialized = ray.is_initialized()
    assert cli_main(["serve", str(path)]) == 2
    assert ray.is_initialized() == was_initialized
    err = capsys.readouterr().err
    assert "GGUF architecture 'gpt2' is not served (served: llama, qwen3, qwen3moe)" in err and err.count("\n") == 1

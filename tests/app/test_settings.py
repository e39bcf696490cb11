"""Each setting declared once: the deployments' configs derive from AppArgs, the flags from the fields."""

import argparse
from pathlib import Path

import pytest

from deployments.config import AuthSettings, EngineConfig, EngineKnobs, IngressSettings
from serve_app import cli_serve
from serve_app.args import AppArgs
from serve_app.cli import build_parser
from serve_app.cli_serve import app_args_from

# Every engine setting, each away from its default: the engine config must carry them all, as given.
ENGINE_VALUES = {
    "dtype": "float16",
    "device": "cpu",
    "backend": "torch",
    "context": 300,
    "parallel": 3,
    "block_size": 32,
    "prefill_chunk_size": 64,
    "decode_share": 0.5,
    "prompt_cache_gib": 1.5,
    "kv_cache_gib": 2.0,
    "default_max_tokens": 9,
    "stream_interval_ms": 5.0,
    "stream_events_per_second": 50.0,
    "engine_process": False,
    "engine_threads": 3,
    "draft": "ngram",
    "draft_tokens": 2,
    "draft_policy": "fixed",
    "learn": True,
    "learn_conversations": True,
    "learn_dir": "/tmp/learned",
    "learn_gib": 8.0,
    "learn_min_free_gib": 1.0,
    "learn_daily_gib": 2.0,
    "tensor_parallel_size": 2,
}
# `tensorfold serve`'s flags and the setting each sets: today's, and --kv-cache-gib, the one flag added.
SERVE_FLAGS = {
    "--host": "host",
    "--port": "port",
    "--name": "name",
    "--alias": "aliases",
    "--context": "context",
    "--parallel": "parallel",
    "--dtype": "dtype",
    "--device": "device",
    "--backend": "backend",
    "--tensor-parallel-size": "tensor_parallel_size",
    "--data-parallel-size": "data_parallel_size",
    "--placement-strategy": "placement_strategy",
    "--router": "router",
    "--draft": "draft",
    "--draft-tokens": "draft_tokens",
    "--draft-policy": "draft_policy",
    "--prompt-cache-gib": "prompt_cache_gib",
    "--kv-cache-gib": "kv_cache_gib",
    "--decode-share": "decode_share",
    "--default-max-tokens": "default_max_tokens",
    "--engine-threads": "engine_threads",
    "--chat-template": "chat_template",
    "--reasoning-effort": "reasoning_effort",
    "--thinking-budget": "thinking_budget",
    "--loop-guard": "loop_guard",
    "--api-key": "api_keys",
    "--api-key-file": "api_key_file",
    "--metrics-open": "metrics_open",
    "--max-body-bytes": "max_body_bytes",
    "--dashboard": "dashboard",
    "--learn": "learn",
    "--learn-conversations": "learn_conversations",
    "--learn-dir": "learn_dir",
    "--learn-gib": "learn_gib",
    "--learn-min-free-gib": "learn_min_free_gib",
    "--learn-daily-gib": "learn_daily_gib",
    "--ready-wait": "ready_wait_s",
    "--http-entry": "http_entry",
}
# Every key the YAML's `args` took before the settings were declared once: each keeps working.
KEYS_BEFORE = [
    "model",
    "name",
    "aliases",
    "host",
    "port",
    "http_entry",
    "api_keys",
    "api_key_file",
    "metrics_open",
    "max_body_bytes",
    "dashboard",
    "ready_wait_s",
    "context",
    "parallel",
    "dtype",
    "device",
    "backend",
    "block_size",
    "prefill_chunk_size",
    "decode_share",
    "prompt_cache_gib",
    "kv_cache_gib",
    "default_max_tokens",
    "stream_interval_ms",
    "stream_events_per_second",
    "engine_process",
    "engine_threads",
    "draft",
    "draft_tokens",
    "draft_policy",
    "learn",
    "learn_conversations",
    "learn_dir",
    "learn_gib",
    "learn_min_free_gib",
    "learn_daily_gib",
    "chat_template",
    "reasoning_effort",
    "thinking_budget",
    "loop_guard",
    "tensor_parallel_size",
    "data_parallel_size",
    "placement_strategy",
    "max_ongoing_requests",
    "router",
    "routing_balance_abs",
    "routing_balance_rel",
    "routing_min_match",
    "routing_stats_period_s",
    "ingress_cpus",
    "renderer_cpus",
    "scheduler_cpus",
    "rank_cpus",
]


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    directory = tmp_path / "my-model"
    directory.mkdir()
    return directory


def serve_parser() -> argparse.ArgumentParser:
    subparsers = argparse.ArgumentParser().add_subparsers()
    cli_serve.register(subparsers)
    return subparsers.choices["serve"]


def test_every_engine_setting_reaches_the_engine_config(ckpt: Path) -> None:
    assert all(value != EngineKnobs.model_fields[key].default for key, value in ENGINE_VALUES.items())
    args = AppArgs(model=str(ckpt), ingress_cpus=0.3, renderer_cpus=0.2, **ENGINE_VALUES)
    config = args.engine_config()
    assert config == EngineConfig(model=str(ckpt.resolve()), reserved_cpus=0.5, **ENGINE_VALUES)
    assert all(getattr(config, key) == getattr(args, key) for key in EngineKnobs.model_fields)  # a new one too


def test_the_engine_configs_defaults_are_the_served_ones(ckpt: Path) -> None:
    """A test that builds EngineConfig directly runs the engine `tensorfold serve` and the YAML configs run."""
    served = AppArgs(model=str(ckpt)).engine_config()
    assert served == EngineConfig(model=str(ckpt.resolve()), reserved_cpus=served.reserved_cpus)
    assert (served.engine_process, served.stream_interval_ms, served.stream_events_per_second) == (True, 0.0, 200.0)


def test_ingress_settings_carry_the_ingress_knobs(ckpt: Path) -> None:
    auth = AuthSettings(key_file="/keys", metrics_open=True)
    knobs = {"thinking_budget": 7, "loop_guard": True, "max_body_bytes": 4096, "dashboard": True, "ready_wait_s": 2.5}
    args = AppArgs(model=str(ckpt), name="m", aliases=["a"], learn_conversations=True, **knobs)
    expected = IngressSettings(served_name="m", model_ids=["m", "a"], auth=auth, learn_conversations=True, **knobs)
    assert args.ingress_settings(auth) == expected
    defaults = AppArgs(model=str(ckpt)).ingress_settings(AuthSettings())
    assert defaults == IngressSettings(served_name="my-model", model_ids=["my-model"])


def test_serve_keeps_its_flags_and_adds_none_for_a_yaml_only_key() -> None:
    """A setting added later gets its flag unless marked NO_FLAG; the keys that had none still have none."""
    actions = serve_parser()._actions
    flags = {option: action.dest for action in actions for option in action.option_strings}
    assert SERVE_FLAGS.items() <= flags.items()
    yaml_only = set(KEYS_BEFORE) - set(SERVE_FLAGS.values()) - {"model"}
    assert yaml_only and not yaml_only & set(flags.values())
    assert [action.dest for action in actions if not action.option_strings] == ["model"]


def test_every_other_flag_sets_its_field(ckpt: Path, tmp_path: Path) -> None:
    """The flags test_args.py's CLI test leaves out, each given a value away from its default."""
    argv = f"""serve {ckpt} --device cpu --backend torch --placement-strategy PACK --draft ngram --draft-tokens 2
        --draft-policy fixed --default-max-tokens 9 --engine-threads 3 --kv-cache-gib 2 --chat-template t.jinja
        --reasoning-effort low --thinking-budget 5 --loop-guard --api-key k1 --api-key k2 --api-key-file keys.txt
        --metrics-open --max-body-bytes 4096 --dashboard --learn --learn-conversations --learn-dir {tmp_path}
        --learn-gib 8 --learn-min-free-gib 1 --learn-daily-gib 2"""
    args = app_args_from(build_parser().parse_args(argv.split()))
    expected = AppArgs(
        model=str(ckpt),
        device="cpu",
        backend="torch",
        placement_strategy="PACK",
        draft="ngram",
        draft_tokens=2,
        draft_policy="fixed",
        default_max_tokens=9,
        engine_threads=3,
        kv_cache_gib=2.0,
        chat_template="t.jinja",
        reasoning_effort="low",
        thinking_budget=5,
        loop_guard=True,
        api_keys=["k1", "k2"],
        api_key_file="keys.txt",
        metrics_open=True,
        max_body_bytes=4096,
        dashboard=True,
        learn=True,
        learn_conversations=True,
        learn_dir=str(tmp_path),
        learn_gib=8.0,
        learn_min_free_gib=1.0,
        learn_daily_gib=2.0,
    )
    assert args == expected


def test_switches_stay_unset_unless_given_and_http_entry_is_the_commands(ckpt: Path) -> None:
    namespace = build_parser().parse_args(["serve", str(ckpt)])
    assert namespace.dashboard is None and namespace.learn is None and namespace.api_keys is None
    assert namespace.http_entry == "ingress" and AppArgs(model=str(ckpt)).http_entry == "proxy"
    assert build_parser().parse_args(["serve", str(ckpt), "--http-entry", "proxy"]).http_entry == "proxy"


def test_bad_flag_values_are_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--dtype", "bogus"], ["--parallel", "x"], ["--port", "p"]):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(["serve", "builtin:tiny-glm", *argv])
        assert info.value.code == 2 and argv[0] in capsys.readouterr().err


def test_every_earlier_key_is_still_a_setting() -> None:
    assert len(KEYS_BEFORE) == 53
    assert set(KEYS_BEFORE) <= set(AppArgs.model_fields)

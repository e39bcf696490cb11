"""`tensorfold serve MODEL [flags]`: build AppArgs from flags and run the same graph as YAML.

Every flag is generated from a setting's declaration (serve_app/settings.py): its name, type, choices and
help; a flag is left out where the setting is marked NO_FLAG (deployments/config.py).

Starts (or joins, with RAY_ADDRESS) a Ray cluster, runs the app on the given host and port, and blocks
until SIGINT or SIGTERM, then drains (deployments/ingress/http/drain.py) and shuts Serve and Ray down so no
replica or rank process is left behind.
"""

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Any, NoReturn

from pydantic import ValidationError

from deployments.config import AuthSettings, StartupError
from deployments.ingress.http.keys import ENV_VAR as API_KEY_ENV
from deployments.ingress.http.keys import auth_settings
from deployments.model_rank.backend import resolve_backend
from deployments.model_rank.models import check_checkpoint
from deployments.tokenizer import CheckpointError
from serve_app.args import AppArgs
from serve_app.launch import HttpEntry
from serve_app.listen_checks import exposure_warning, port_taken, raise_open_file_limit
from serve_app.settings import Setting, settings, type_label, value_label

APP_NAME = "tensorfold"
RAY_PROBE_S = 2.0  # how long a stop waits for Ray's GCS to answer before it stops without a drain
log = logging.getLogger("tensorfold.cli")


def _help(setting: Setting) -> str:
    """The flag's help: its own line or the setting's description, then what the default is."""
    text = setting.flag.help or setting.description
    default = setting.flag.default if setting.flag.default is not None else setting.default
    if setting.flag.repeatable:
        text += " (repeatable)"
    elif not setting.flag.positional and default is not None and default is not False:
        text += f" (default {value_label(default)})"
    return text.replace("%", "%%")  # argparse formats help with %


def _flag_options(setting: Setting) -> dict[str, Any]:
    """add_argument's options for a setting: a switch for a bool, choices for words, else a typed value."""
    options: dict[str, Any] = {"help": _help(setting)}
    if setting.flag.positional:
        return {**options, "metavar": setting.flag_name}
    options.update(dest=setting.key, default=setting.flag.default)
    if setting.options == (bool,):
        if setting.default is not False:
            raise TypeError(f"{setting.key}: a switch cannot turn off a true default; mark it NO_FLAG")
        return {**options, "action": "store_true"}  # None when absent, so AppArgs' default applies
    if setting.flag.repeatable:
        options["action"] = "append"
    elif setting.choices is not None:
        return {**options, "choices": setting.choices}
    elif setting.options != (str,):
        options["type"] = _value_type(setting)
    return {**options, "metavar": setting.flag.metavar or setting.flag_name.lstrip("-").replace("-", "_").upper()}


def _value_type(setting: Setting) -> Any:
    """The flag's converter: the setting's one type, or (`int / auto`) its words else that type."""
    if len(setting.options) == 1:
        return setting.options[0]

    def parse(text: str) -> Any:
        return setting.parse(text)

    parse.__name__ = type_label(setting)  # argparse names it in "invalid ... value"
    return parse


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible)")
    add_serve_flags(parser)
    parser.set_defaults(func=run)


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """MODEL and every setting's flag (also `tensorfold service install`'s, which forwards them)."""
    for setting in settings():
        if setting.flag.exists:
            name = setting.key if setting.flag.positional else setting.flag_name
            parser.add_argument(name, **_flag_options(setting))


def serve_argv(namespace: argparse.Namespace) -> list[str]:
    """The flags given, as `tensorfold serve` reads them back: MODEL first, then each flag set."""
    argv: list[str] = []
    for setting in settings():
        value = getattr(namespace, setting.key, None)
        if not setting.flag.exists or value is None or value is False:
            continue
        if setting.flag.positional:
            argv.insert(0, str(value))
        elif value is True:
            argv.append(setting.flag_name)
        else:
            for item in value if setting.flag.repeatable else [value]:
                argv += [setting.flag_name, str(item)]
    return argv


def app_args_from(namespace: argparse.Namespace) -> AppArgs:
    """Only the flags given override AppArgs' defaults, so the CLI and YAML share one set of defaults. A flag
    with a default of its own (--http-entry) is a launch choice that run() applies after the checks."""
    values: dict[str, Any] = {}
    for setting in settings():
        value = getattr(namespace, setting.key, None)
        if setting.flag.exists and setting.flag.default is None and value is not None:
            values[setting.key] = value
    return AppArgs(**values)


class _StopSignal:
    """SIGINT/SIGTERM: during startup, interrupt it; once serving, wake the main thread to shut down.
    SIGHUP: wake the main thread to ask every Ingress replica to re-read its key file."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.received: str | None = None
        self.serving = False
        self.reloads = 0  # SIGHUPs not yet passed on

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        if hasattr(signal, "SIGHUP"):
            signal.signal(signal.SIGHUP, self._reload)

    def _reload(self, _signum: int, _frame: Any) -> None:
        self.reloads += 1
        self.event.set()

    def wait_for_stop(self, on_reload: Any) -> None:
        """Block until SIGINT/SIGTERM, calling `on_reload()` for each SIGHUP meanwhile."""
        while True:
            self.event.wait()
            self.event.clear()
            while self.reloads:
                self.reloads -= 1
                on_reload()
            if self.received is not None:
                return

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = signal.Signals(signum).name
        if not self.serving:
            raise KeyboardInterrupt(self.received)  # unwinds startup; the caller's finally cleans up
        self.event.set()


def serve_blocking(args: AppArgs, auth: AuthSettings, entry: HttpEntry = "ingress") -> int:
    """`auth`: the keys' digests, read before Ray starts; no raw key reaches a Ray process's environment."""
    from serve_app.launch import init_ray, run_graph

    stop = _StopSignal()
    limits = raise_open_file_limit()  # before ray.init: the raylet, and so the replica serving HTTP, inherit it
    if limits is not None:
        log.info("open-file limit: soft %d (was %d)", limits[1], limits[0])
    os.environ.pop(API_KEY_ENV, None)  # Ray's processes inherit this environment: the digests travel instead
    init_ray(entry, args.port)  # before this process imports Ray: a Ray it starts stays on loopback
    import ray
    from ray import serve

    stop.install()  # after ray.init, which installs its own SIGTERM handler (exit without Serve's shutdown)
    ray_answers = True
    try:
        url = run_graph(args, entry, APP_NAME, auth)
        stop.serving = True
        print(f"tensorfold: serving {args.served_name} at {url} ({entry} answers HTTP)", flush=True)
        stop.wait_for_stop(_reload_keys)
        ray_answers = _ray_answers()
        if not ray_answers:  # a drain or Serve's shutdown would wait a minute on it before Ray ends this process
            print(f"tensorfold: {stop.received}, but Ray no longer answers: exiting without a drain", file=sys.stderr)
            return 1
        print(f"tensorfold: {stop.received}, draining for up to {args.drain_grace_s:g} s", flush=True)
        _drain(args.drain_grace_s)
        print("tensorfold: shutting down", flush=True)
        return 0
    except KeyboardInterrupt:
        print("tensorfold: interrupted during startup, shutting down", flush=True)
        return 130
    except Exception as exc:
        print(f"tensorfold: the server did not start: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        _shutdown(serve, ray, ray_answers)


def _reload_keys() -> None:
    from deployments.ingress.http.key_store import request_reload

    try:
        for outcome in request_reload(APP_NAME):
            print(f"tensorfold: SIGHUP, an Ingress replica {outcome}", flush=True)
    except Exception as exc:  # keep serving: the file's mtime check still picks up the change within a second
        print(f"tensorfold: SIGHUP, reload request failed: {exc}", file=sys.stderr, flush=True)


def _drain(grace_s: float) -> None:
    from deployments.ingress.http.drain import request_drain

    try:
        for outcome in request_drain(APP_NAME, grace_s):
            print(f"tensorfold: an Ingress replica {outcome}", flush=True)
    except Exception as exc:  # stop anyway: Serve's own shutdown still lets replies finish within its budget
        print(f"tensorfold: the drain failed: {exc}", file=sys.stderr, flush=True)


def _ray_answers(timeout_s: float = RAY_PROBE_S) -> bool:
    """Whether this command's Ray still answers: its GCS (gone when someone killed it, or `ray stop`)."""
    from ray._private.worker import global_worker  # the driver's own client: a new one waits a minute to connect
    from ray.exceptions import RpcError

    try:
        global_worker.gcs_client.check_alive([], timeout=timeout_s)
    except RpcError:
        return False
    return True


def _shutdown(serve: Any, ray: Any, ray_answers: bool = True) -> None:
    """Serve first (replicas and rank actors stop), then the local Ray processes this command started."""
    if not ray_answers:
        _exit_without_ray()
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def _exit_without_ray() -> NoReturn:
    """Ray's own exit would wait a minute on the GCS too. What is left of Ray here serves nothing, and it holds
    SIGTERM (serve_app/launch.py): it goes with SIGKILL, then this process exits at once."""
    import psutil

    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            process.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def run(namespace: argparse.Namespace) -> int:
    try:
        args = app_args_from(namespace)
    except ValidationError as exc:
        print(f"tensorfold serve: {exc}", file=sys.stderr)
        return 2
    try:  # a checkpoint or backend that cannot run here refuses before Ray starts
        check_checkpoint(args.model_dir)
        resolve_backend(args.engine_config())
    except (CheckpointError, StartupError) as exc:
        print(f"tensorfold serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:  # a bad key file (mode, content) refuses to start before Ray does
        auth = auth_settings(args.api_keys, args.api_key_file, args.metrics_open, os.environ.get(API_KEY_ENV))
    except ValueError as exc:
        print(f"tensorfold serve: {exc}", file=sys.stderr)
        return 2
    taken = port_taken(args.host, args.port)
    if taken is not None:
        print(f"tensorfold serve: {taken}", file=sys.stderr)
        return 2
    warning = exposure_warning(args.host, auth.enabled)
    if warning:
        print(f"tensorfold: {warning}", file=sys.stderr, flush=True)
    args = args.model_copy(update={"http_entry": namespace.http_entry})  # the Ingress replica's env follows it
    return serve_blocking(args, auth, namespace.http_entry)

"""`tensorfold service install|uninstall|status`: the server as a system service (docs/service.md).

`install MODEL [serve flags]` checks the flags as `tensorfold serve` would (and the key file's mode), then
writes a systemd unit (Linux; `--user` for a per-user one) or a launchd agent (macOS) whose command is
`tensorfold serve MODEL [flags]`, and enables it; `--dry-run` prints the file instead.
"""

import argparse
import getpass
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from deployments.ingress.http.keys import KeyFileError, read_key_file
from deployments.model_rank.models import check_checkpoint
from deployments.tokenizer import CheckpointError
from serve_app.cli_serve import add_serve_flags, app_args_from, serve_argv
from serve_app.service_units import ServiceSpec, launchd_label, launchd_plist, systemd_unit

FORMATS = ("systemd", "launchd")


class ServiceError(Exception):
    """A flag or file the service cannot be installed with (one line for the operator)."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("service", help="run the server as a system service (systemd, launchd)")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    install = actions.add_parser("install", help="write and enable a service running `tensorfold serve`")
    _common(install)
    install.add_argument("--dry-run", action="store_true", help="print the unit (or plist) instead")
    add_serve_flags(install)
    install.set_defaults(func=run_install)
    for action, help_text, func in (
        ("uninstall", "stop, disable and remove the service", run_uninstall),
        ("status", "the service manager's view of the service", run_status),
    ):
        sub = actions.add_parser(action, help=help_text)
        _common(sub)
        sub.set_defaults(func=func)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--service-name", dest="service", default="tensorfold", help="the service's name (default tensorfold)"
    )
    parser.add_argument("--user", action="store_true", help="a per-user service (systemctl --user)")
    default = "launchd" if sys.platform == "darwin" else "systemd"
    parser.add_argument("--format", choices=FORMATS, default=default, help=f"the service manager (default {default})")


def run_install(namespace: argparse.Namespace) -> int:
    try:
        spec = service_spec(namespace)
    except ServiceError as exc:
        print(f"tensorfold service install: {exc}", file=sys.stderr)
        return 2
    text = systemd_unit(spec).encode() if namespace.format == "systemd" else launchd_plist(spec)
    if namespace.dry_run:
        sys.stdout.write(text.decode())
        return 0
    path = unit_path(namespace)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text)
    path.chmod(0o644)
    print(f"tensorfold: wrote {path}")
    for command in _enable_commands(namespace, path):
        subprocess.run(command, check=True)
    print(f"tensorfold: {spec.name} enabled and started; logs: {_logs_hint(namespace)}")
    return 0


def service_spec(namespace: argparse.Namespace) -> ServiceSpec:
    """The flags checked as `serve` checks them, the paths made absolute, and what the unit needs."""
    if namespace.api_keys:
        raise ServiceError(
            "a key given with --api-key would be written into the unit; use --api-key-file (0600) or "
            "TENSORFOLD_API_KEY in the service's environment file"
        )
    model = Path(namespace.model).expanduser()
    if model.exists():
        namespace.model = str(model.resolve())
    if namespace.api_key_file:
        namespace.api_key_file = str(Path(namespace.api_key_file).expanduser().resolve())
        try:
            read_key_file(Path(namespace.api_key_file))
        except KeyFileError as exc:
            raise ServiceError(str(exc)) from None
    try:
        args = app_args_from(namespace)
        check_checkpoint(args.model_dir)
    except (ValidationError, CheckpointError) as exc:
        raise ServiceError(str(exc)) from None
    run_as = None if namespace.user else (os.environ.get("SUDO_USER") or getpass.getuser())
    home = Path(pwd.getpwnam(run_as).pw_dir) if run_as else Path.home()
    learn_dir = (
        Path(args.learn_dir.replace("~", str(home), 1)) if args.learn_dir.startswith("~") else Path(args.learn_dir)
    )
    return ServiceSpec(
        name=namespace.service,
        argv=[*_tensorfold_command(), "serve", *serve_argv(namespace)],
        user=namespace.user,
        run_as=run_as,
        environment_file=_config_dir(namespace, home) / f"{namespace.service}.env",
        writable=[learn_dir, home / ".cache" / "tensorfold", home / ".triton"],
        working_directory=home,
        log_dir=home / "Library" / "Logs" if namespace.format == "launchd" else None,
    )


def _tensorfold_command() -> list[str]:
    """This installation's `tensorfold` script, else this interpreter running the CLI module."""
    script = Path(sys.executable).parent / "tensorfold"
    if script.exists():
        return [str(script)]
    found = shutil.which("tensorfold")
    return [found] if found else [sys.executable, "-m", "serve_app.cli"]


def _config_dir(namespace: argparse.Namespace, home: Path) -> Path:
    return (
        home / ".config" / "tensorfold" if namespace.user or namespace.format == "launchd" else Path("/etc/tensorfold")
    )


def unit_path(namespace: argparse.Namespace) -> Path:
    if namespace.format == "launchd":
        return Path.home() / "Library" / "LaunchAgents" / f"{launchd_label(namespace.service)}.plist"
    folder = Path.home() / ".config" / "systemd" / "user" if namespace.user else Path("/etc/systemd/system")
    return folder / f"{namespace.service}.service"


def _systemctl(namespace: argparse.Namespace) -> list[str]:
    return ["systemctl", "--user"] if namespace.user else ["systemctl"]


def _enable_commands(namespace: argparse.Namespace, path: Path) -> list[list[str]]:
    if namespace.format == "launchd":
        return [["launchctl", "bootstrap", f"gui/{os.getuid()}", str(path)]]
    return [[*_systemctl(namespace), "daemon-reload"], [*_systemctl(namespace), "enable", "--now", path.name]]


def _logs_hint(namespace: argparse.Namespace) -> str:
    if namespace.format == "launchd":
        return f"~/Library/Logs/{namespace.service}.log"
    return " ".join(["journalctl", *(["--user"] if namespace.user else []), "-u", namespace.service, "-f"])


def run_uninstall(namespace: argparse.Namespace) -> int:
    path = unit_path(namespace)
    if namespace.format == "launchd":
        subprocess.run(["launchctl", "bootout", f"gui/{os.getuid()}/{launchd_label(namespace.service)}"], check=False)
        path.unlink(missing_ok=True)
    else:
        subprocess.run([*_systemctl(namespace), "disable", "--now", path.name], check=False)
        path.unlink(missing_ok=True)
        subprocess.run([*_systemctl(namespace), "daemon-reload"], check=False)
    print(f"tensorfold: removed {path}")
    return 0


def run_status(namespace: argparse.Namespace) -> int:
    if namespace.format == "launchd":
        command = ["launchctl", "print", f"gui/{os.getuid()}/{launchd_label(namespace.service)}"]
    else:
        command = [*_systemctl(namespace), "status", "--no-pager", f"{namespace.service}.service"]
    return subprocess.run(command, check=False).returncode

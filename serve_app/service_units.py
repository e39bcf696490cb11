"""The files `tensorfold service install` writes: a systemd unit (Linux) or a launchd agent (macOS).

Rendering only; the command (serve_app/cli_service.py) checks the flags and installs. No key is ever written
into a unit: keys come from the key file (`--api-key-file`, read by the server) or the optional environment
file beside the unit (`TENSORFOLD_API_KEY=...`, owner-only), never from the command line (docs/service.md).
"""

import plistlib
import re
from dataclasses import dataclass, field
from pathlib import Path

# The server's stop: drain (up to its grace) and the prompt store's flush (20 s) fit with room to spare.
STOP_TIMEOUT_S = 90
OPEN_FILES = 65536  # one per connection, plus Ray's sockets and pipes


@dataclass
class ServiceSpec:
    """What one installed server is (set by the command from its flags)."""

    name: str  # the unit's name: `<name>.service`, launchd label `ai.tensorfold.<name>`
    argv: list[str]  # the absolute command: the tensorfold executable, `serve`, MODEL and the flags
    user: bool  # a per-user unit (`systemctl --user`) rather than a system one
    run_as: str | None = None  # a system unit's `User=` (the installing user; never root by default)
    environment_file: Path | None = None  # read if present: where an operator puts TENSORFOLD_API_KEY
    writable: list[Path] = field(default_factory=list)  # folders the server writes: the store, kernel caches
    working_directory: Path | None = None  # the home folder the server starts in
    log_dir: Path | None = None  # launchd's stdout / stderr files (systemd uses the journal)


SAFE_WORD = re.compile(r"[A-Za-z0-9_@%+=:,./$-]+")


def _systemd_quote(word: str) -> str:
    """One ExecStart word: systemd expands `%` specifiers and `$` variables, so those are doubled; a word
    with anything else outside the safe set is double-quoted, its backslashes and quotes escaped."""
    word = word.replace("%", "%%").replace("$", "$$")
    if SAFE_WORD.fullmatch(word):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_unit(spec: ServiceSpec) -> str:
    """A hardened service that restarts on failure and keeps GPUs visible (no PrivateDevices)."""
    lines = [
        "[Unit]",
        f"Description=TensorFold LLM server ({spec.name})",
        "Wants=network-online.target",
        "After=network-online.target",
        "",
        "[Service]",
        "Type=simple",
        "ExecStart=" + " ".join(_systemd_quote(word) for word in spec.argv),
    ]
    if spec.run_as:
        lines.append(f"User={spec.run_as}")
    if spec.working_directory:
        lines.append(f"WorkingDirectory={spec.working_directory}")
    if spec.environment_file:
        lines.append(f"EnvironmentFile=-{spec.environment_file}")  # `-`: optional
    lines += [
        "Environment=PYTHONUNBUFFERED=1",
        "Restart=on-failure",
        "RestartSec=5",
        f"TimeoutStopSec={STOP_TIMEOUT_S}",
        "KillSignal=SIGTERM",
        # SIGTERM to the server alone, which drains and stops Ray itself; SIGKILL to whatever is left once it
        # exits. (It holds out against a signal to every process too: docs/service.md.)
        "KillMode=mixed",
        f"LimitNOFILE={OPEN_FILES}",
        "UMask=0077",
        "NoNewPrivileges=yes",
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
        "ProtectSystem=strict",
        "ProtectHome=read-only",  # the model and key file are read; the writable folders are listed below
        "PrivateTmp=yes",  # Ray's session folder lives in /tmp
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectControlGroups=yes",
        "ProtectKernelLogs=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "RestrictRealtime=yes",
        "RestrictNamespaces=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "SystemCallArchitectures=native",
        "PrivateMounts=yes",
        # Groups no server needs; @resources (the open-file limit) and @debug (profilers) stay allowed.
        "SystemCallFilter=~@clock @cpu-emulation @module @mount @obsolete @raw-io @reboot @swap",
    ]
    lines += [f"ReadWritePaths=-{path}" for path in spec.writable]  # `-`: skipped while it does not exist
    lines += ["", "[Install]", "WantedBy=" + ("default.target" if spec.user else "multi-user.target"), ""]
    return "\n".join(lines)


def launchd_plist(spec: ServiceSpec) -> bytes:
    """A launchd agent: started at login, restarted when it exits with a failure."""
    agent: dict = {
        "Label": launchd_label(spec.name),
        "ProgramArguments": spec.argv,
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ExitTimeOut": STOP_TIMEOUT_S,
        "SoftResourceLimits": {"NumberOfFiles": OPEN_FILES},
        "EnvironmentVariables": {"PYTHONUNBUFFERED": "1"},
    }
    if spec.working_directory:
        agent["WorkingDirectory"] = str(spec.working_directory)
    if spec.log_dir:
        agent["StandardOutPath"] = str(spec.log_dir / f"{spec.name}.log")
        agent["StandardErrorPath"] = str(spec.log_dir / f"{spec.name}.log")
    return plistlib.dumps(agent)


def launchd_label(name: str) -> str:
    return f"ai.tensorfold.{name}"

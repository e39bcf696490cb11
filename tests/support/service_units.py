"""Reading back what `tensorfold service install --dry-run` prints: the unit's ExecStart as an argv."""

import shlex
import subprocess
import sys

from tests.conftest import REPO


def dry_run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "serve_app", "service", "install", "--dry-run", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def exec_start(unit: str) -> list[str]:
    """The unit's command: systemd's word splitting is a shell's for words without `$` or `%`."""
    (line,) = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    words = line.removeprefix("ExecStart=")
    assert "$" not in words and "%" not in words, words
    return shlex.split(words)


def service_command(serve_flags: list[str], env: dict[str, str]) -> list[str]:
    """The command a per-user systemd unit for these `serve` flags would run."""
    result = dry_run(["--user", "--format", "systemd", *serve_flags], env)
    assert result.returncode == 0, result.stderr
    return exec_start(result.stdout)

"""`tensorfold service install`: the unit it writes passes systemd's own checks with a good security score,
never holds a key, forwards the serve flags it was given (checked as `serve` checks them), and the launchd
agent runs the same command. (tests/e2e/test_cli_serve_e2e.py starts its server from the unit's ExecStart.)"""

import os
import plistlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from serve_app.cli import main
from serve_app.fixtures.tiny_glm import BUILTIN_DIR
from tests.support.service_units import exec_start

ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


@pytest.fixture()
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text("alice: sk-alice-secret-0123456789\n")
    path.chmod(0o600)
    return path


def dry_run(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """`tensorfold service install --dry-run ARGS`, in this process: (exit code, stdout, stderr)."""
    try:
        code = main(["service", "install", "--dry-run", *args])
    except SystemExit as exc:  # argparse's refusals
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture()
def unit_of(tmp_path: Path, capsys: pytest.CaptureFixture):
    def write(*args: str) -> Path:
        code, out, err = dry_run(["builtin:tiny-glm", *args], capsys)
        assert code == 0, err
        unit = tmp_path / "tensorfold.service"
        unit.write_text(out)
        return unit

    return write


@needs_systemd_analyze
def test_unit_passes_systemd_verify(unit_of, key_file: Path) -> None:
    unit = unit_of("--api-key-file", str(key_file), "--port", "8123")
    result = subprocess.run([ANALYZE, "verify", str(unit)], capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "", result.stderr


@needs_systemd_analyze
def test_a_stop_signals_the_server_alone_then_kills_what_is_left(unit_of) -> None:
    """KillMode=mixed: SIGTERM to the main process (it drains and stops Ray), SIGKILL to the rest once it exits;
    systemd's own parser accepts the line (a misspelt mode is a verify warning)."""
    unit = unit_of()
    assert re.findall(r"^KillMode=(.*)$", unit.read_text(), flags=re.M) == ["mixed"]
    result = subprocess.run([ANALYZE, "verify", str(unit)], capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    unit.write_text(unit.read_text().replace("KillMode=mixed", "KillMode=mixd"))
    refused = subprocess.run([ANALYZE, "verify", str(unit)], capture_output=True, text=True)
    assert "kill mode" in refused.stderr, refused.stderr  # the check above would have seen a bad mode


@needs_systemd_analyze
def test_unit_security_exposure_is_low(unit_of) -> None:
    unit = unit_of()
    result = subprocess.run([ANALYZE, "security", "--offline=yes", str(unit)], capture_output=True, text=True)
    exposure = float(re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout).group(1))
    assert exposure <= 3.0, result.stdout


def test_unit_restarts_on_failure_outlasts_the_drain_and_keeps_gpus(unit_of) -> None:
    text = unit_of().read_text()
    lines = ("Restart=on-failure", "LimitNOFILE=65536", "NoNewPrivileges=yes", "ProtectSystem=strict", "KillMode=mixed")
    for line in lines:
        assert line in text.splitlines()
    assert int(re.search(r"TimeoutStopSec=(\d+)", text).group(1)) >= 30  # drain, then the store's 20 s flush
    assert "PrivateDevices" not in text and "DevicePolicy" not in text  # /dev/nvidia* stay visible
    assert "ReadWritePaths=-" + str(Path.home() / ".cache" / "tensorfold" / "learned") in text
    assert re.search(r"EnvironmentFile=-/etc/tensorfold/tensorfold\.env", text)


def test_unit_runs_serve_with_the_flags_given_and_the_key_file_path_only(unit_of, key_file: Path) -> None:
    text = unit_of("--api-key-file", str(key_file), "--alias", "my model", "--port", "8123").read_text()
    argv = exec_start(text)
    assert argv[1:3] == ["serve", "builtin:tiny-glm"]
    assert argv[argv.index("--alias") + 1] == "my model" and argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--api-key-file") + 1] == str(key_file)
    assert "sk-alice-secret" not in text
    assert os.access(argv[0], os.X_OK)


def test_relative_model_and_key_paths_become_absolute(
    tmp_path: Path, key_file: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ckpt").symlink_to(BUILTIN_DIR)
    monkeypatch.chdir(tmp_path)
    code, out, err = dry_run(["ckpt", "--api-key-file", key_file.name], capsys)
    assert code == 0, err
    argv = exec_start(out)
    assert argv[2] == str(BUILTIN_DIR.resolve()) and argv[argv.index("--api-key-file") + 1] == str(key_file)


def test_a_key_on_the_command_line_is_refused(capsys: pytest.CaptureFixture) -> None:
    code, out, err = dry_run(["builtin:tiny-glm", "--api-key", "sk-inline-secret"], capsys)
    assert code == 2 and out == ""
    assert "--api-key-file" in err and "sk-inline-secret" not in err


def test_a_key_file_readable_by_others_is_refused(key_file: Path, capsys: pytest.CaptureFixture) -> None:
    key_file.chmod(0o644)
    code, out, err = dry_run(["builtin:tiny-glm", "--api-key-file", str(key_file)], capsys)
    assert code == 2 and out == "" and "chmod 600" in err


def test_bad_serve_flags_are_refused_before_any_file_is_written(capsys: pytest.CaptureFixture) -> None:
    code, out, err = dry_run(["builtin:tiny-glm", "--max-body-bytes", "-5"], capsys)
    assert code == 2 and out == "" and "max_body_bytes" in err
    code, out, err = dry_run([str(BUILTIN_DIR.parent / "no-such-model")], capsys)
    assert code == 2 and out == "" and "no-such-model" in err


def test_launchd_agent_runs_the_same_command(unit_of, capsys: pytest.CaptureFixture) -> None:
    systemd = exec_start(unit_of("--port", "8123").read_text())
    code, out, _ = dry_run(["--format", "launchd", "builtin:tiny-glm", "--port", "8123"], capsys)
    agent = plistlib.loads(out.encode())
    assert agent["Label"] == "ai.tensorfold.tensorfold"
    assert agent["ProgramArguments"] == systemd
    assert agent["KeepAlive"] == {"SuccessfulExit": False} and agent["RunAtLoad"] is True

"""Claude Code and Codex, the real CLIs, headless against the real graph: the commands of docs/agents/.

The pages' commands run as written: the fixture line builds the agents' checkpoint, the `tensorfold serve`
line's flags (parsed by the CLI's own parser) become the args of one Serve app both agents share, and each
agent's block runs in bash with only the server's address rewritten. Nothing else is reachable: each agent
gets an empty HOME, telemetry off. The model is random, so its words are noise; what must hold is the
protocol: each agent exits 0 with its own success result, and the server's access log shows every request
answered 200. The CLIs come from npm (.ci/run installs the pinned versions into TENSORFOLD_AGENT_CLIS); the
module skips only where npm itself is absent, and fails, saying how to install them, where they are missing.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from serve_app.cli import build_parser
from serve_app.cli import main as cli_main
from serve_app.cli_serve import app_args_from
from tests.conftest import REPO
from tests.support.serve_harness import delete_apps, deploy_apps, load_app_config

pytestmark = pytest.mark.e2e
PAGES = REPO / "docs" / "agents"
DOCS_URL = "http://127.0.0.1:8080"  # the address the pages' commands use
DOCS_MODEL = "/tmp/agent-model"  # the checkpoint folder they use
APP, PREFIX = "e2e-agents", "/agents"
CLI_DIR = Path(os.environ.get("TENSORFOLD_AGENT_CLIS", Path.home() / ".cache" / "tensorfold" / "agent-clis"))
RUN_TIMEOUT_S = 300


def _blocks(page: str) -> list[str]:
    text = (PAGES / page).read_text(encoding="utf-8")
    return [block.replace("\\\n", " ") for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def _line(page: str, start: str) -> str:
    """The one command line of `page` that starts with `start`."""
    (line,) = [ln for block in _blocks(page) for ln in block.splitlines() if ln.startswith(start)]
    return line


def _agent_block(page: str, command: str) -> str:
    (block,) = [block for block in _blocks(page) if command in block]
    return block


def _cli(name: str) -> Path:
    if shutil.which("npm") is None:
        pytest.skip("npm is absent, so the agent CLIs cannot be installed (.ci/run installs them where it is)")
    path = CLI_DIR / "node_modules" / ".bin" / name
    if not path.exists():
        pytest.fail(
            f"{name} is not installed under {CLI_DIR}: run "
            f"`npm install --prefix {CLI_DIR} @openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.332` "
            "(as .ci/run does), or point TENSORFOLD_AGENT_CLIS at a folder holding them"
        )
    return path


@pytest.fixture(scope="session", autouse=True)
def clis() -> dict[str, Path]:
    """Both CLIs, checked before anything is built, started or deployed (autouse, session: set up first)."""
    return {name: _cli(name) for name in ("claude", "codex")}


@pytest.fixture(scope="module")
def model_dir(clis: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The agents' checkpoint, built by the pages' fixture command."""
    line = _line("claude-code.md", "tensorfold fixture ")
    assert line == _line("codex.md", "tensorfold fixture ")
    out = tmp_path_factory.mktemp("agent-model")
    assert cli_main(shlex.split(line.replace(DOCS_MODEL, str(out)))[1:]) == 0
    return out


@pytest.fixture(scope="module")
def agents_url(serve_url: str, model_dir: Path) -> Iterator[str]:
    """One app for both agents, with the settings the pages' `tensorfold serve` line gives."""
    line = _line("claude-code.md", "tensorfold serve ")
    assert line == _line("codex.md", "tensorfold serve ")
    argv = shlex.split(line.replace(DOCS_MODEL, str(model_dir)))[1:]
    args = app_args_from(build_parser().parse_args(argv)).model_dump(mode="json", exclude_unset=True)
    deploy_apps([load_app_config("glm.yaml", APP, PREFIX, **args)])
    yield f"{serve_url}{PREFIX}"
    delete_apps([APP])


def _logs_dir() -> Path:
    import ray

    return Path(ray._private.worker._global_node.get_logs_dir_path())


def _log_lines(since: float, logger: str) -> list[str]:
    """The app's `logger` lines stamped at or after `since`: while this module runs, its app is the only one
    deployed (an access line's path is the app's own, without the route prefix)."""
    start = datetime.fromtimestamp(since).strftime("%Y-%m-%d %H:%M:%S")
    lines = []
    for path in _logs_dir().glob("worker-*.err"):
        if path.stat().st_mtime >= since:
            text = path.read_text(encoding="utf-8", errors="replace")
            lines += [ln for ln in text.splitlines() if f" {logger}: " in ln and ln[:19] >= start]
    return lines


def _run(block: str, url: str, home: Path, drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """A page's block in bash, the CLIs on PATH, an empty HOME; `drop` removes a variable the block sets."""
    for name in drop:
        block = re.sub(rf"\b{name}=\S+\s*", "", block)
    path = f"{CLI_DIR / 'node_modules' / '.bin'}{os.pathsep}{os.environ['PATH']}"
    env = {"PATH": path, "HOME": str(home), "LANG": "C.UTF-8", "TERM": "dumb"}
    work = home / "work"
    work.mkdir(parents=True, exist_ok=True)
    command = block.replace(DOCS_URL, url)
    return subprocess.run(
        ["bash", "-c", command],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )


def _answered(since: float, route: str, count_at_least: int) -> list[str]:
    """The access lines for `route`; every one 200, and at least `count_at_least` of them."""
    deadline = time.monotonic() + 10  # Ray writes a worker's stderr to its file as it comes; allow a flush
    while True:
        lines = [ln for ln in _log_lines(since, "tensorfold.access") if f"POST {route} " in ln]
        if len(lines) >= count_at_least or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(lines) >= count_at_least, f"no access lines for {route} in {_logs_dir()}"
    assert all("status=200" in ln for ln in lines), lines
    return lines


def test_claude_code_completes_a_round_trip(agents_url: str, tmp_path: Path) -> None:
    since = time.time() - 1
    done = _run(_agent_block("claude-code.md", "claude -p"), agents_url, tmp_path / "home")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["type"] == "result" and result["subtype"] == "success" and result["is_error"] is False, result
    assert result["api_error_status"] is None and result["num_turns"] >= 1
    (usage,) = result["modelUsage"].values()  # the server's own counts, as Claude Code read them
    assert usage["inputTokens"] > 10_000 and usage["outputTokens"] >= 1
    _answered(since, "/v1/messages", 1)


def test_claude_code_without_its_output_limit_gets_the_windows_refusal(agents_url: str, tmp_path: Path) -> None:
    """What the page says happens when CLAUDE_CODE_MAX_OUTPUT_TOKENS is not set: a 400 before any work."""
    block = _agent_block("claude-code.md", "claude -p")
    done = _run(block, agents_url, tmp_path / "home", drop=("CLAUDE_CODE_MAX_OUTPUT_TOKENS",))
    assert done.returncode == 1
    result = json.loads(done.stdout)
    assert result["is_error"] is True and result["api_error_status"] == 400, result
    assert "maximum context length is 32768 tokens" in result["result"] and "32000 for the reply" in result["result"]


def test_codex_completes_a_round_trip_with_its_default_tools(agents_url: str, tmp_path: Path) -> None:
    since = time.time() - 1
    done = _run(_agent_block("codex.md", "codex exec"), agents_url, tmp_path / "home")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ERROR" not in done.stderr, done.stderr[-3000:]
    # Its transcript ends with the turn's token count once the stream completed (an empty reply prints no
    # `codex` section, and a reply cut at the limit would be an ERROR line).
    assert "tokens used" in done.stderr, done.stderr[-3000:]
    _answered(since, "/v1/responses", 1)
    dropped = [ln for ln in _log_lines(since, "tensorfold.ingress") if "dropped built-in tools" in ln]
    assert dropped and all(ln.endswith("the server does not run: web_search") for ln in dropped), dropped

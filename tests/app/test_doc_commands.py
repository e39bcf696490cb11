"""Every command block of README.md, cluster/README.md and docs/ runs here, so none goes stale unseen.

A ```bash block runs in bash (`set -eo pipefail`, curl failing on an HTTP error) unless the line before its
fence says why it cannot run here: `<!-- not run by the tests: REASON -->` (it starts a server that runs
until stopped, needs several machines, another program, minutes of work, or it is a synopsis). A new block
runs by default. Blocks that talk to the documented server at http://127.0.0.1:8080 run against the test
session's tiny-glm app (configs/glm.yaml, served as `tiny`): the address is rewritten, and the model name the
documented server answers to (`tiny-glm`) becomes the session's. Every fenced block names its language, so a
command cannot slip out of this test unlabelled.
"""

import os
import re
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "cluster" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^([ \t]*)```(.*)$")
SKIP = re.compile(r"^<!-- not run by the tests: (.+) -->$")
DOCUMENTED_SERVER = "http://127.0.0.1:8080"
DOCUMENTED_MODEL = '"model": "tiny-glm"'  # what `serve run configs/glm.yaml` serves the embedded model as
PREAMBLE = 'set -eo pipefail\ncurl() { command curl --fail-with-body "$@"; }\n'
BLOCK_TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # of its opening fence
    language: str
    body: str
    skip: str | None  # why it cannot run here, from the line before its fence

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks, with the skip line just above each fence (indented fences too)."""
    found: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    opened: tuple[int, str, str] | None = None  # (line index, indent, info string)
    for index, line in enumerate(lines):
        fence = FENCE.match(line)
        if fence is None:
            continue
        if opened is None:
            opened = (index, fence.group(1), fence.group(2).strip())
            continue
        start, indent, info = opened
        body = textwrap.dedent("\n".join(lines[start + 1 : index])) + "\n"
        skip = SKIP.match(lines[start - 1].strip()) if start else None
        found.append(Block(str(page.relative_to(REPO)), start + 1, info, body, skip.group(1) if skip else None))
        opened = None
    return found


ALL_BLOCKS = [block for page in PAGES for block in blocks(page)]
BASH_BLOCKS = [block for block in ALL_BLOCKS if block.language.split(" ")[0] == "bash"]
RUN = [block for block in BASH_BLOCKS if block.skip is None]


def test_every_fenced_block_names_its_language() -> None:
    unlabelled = [block.name for block in ALL_BLOCKS if not block.language]
    assert not unlabelled, f"say what each block is (```bash, ```text, ```yaml...): {unlabelled}"


def test_only_bash_blocks_say_why_they_do_not_run() -> None:
    assert not [block.name for block in ALL_BLOCKS if block.skip and block not in BASH_BLOCKS]


@pytest.fixture(scope="module")
def documented_server(glm_base_url: str) -> str:
    """The session's tiny-glm app, as the pages' readers find theirs: it has answered a request already (the
    README's first one), so /metrics has a request to count."""
    reply = httpx.post(f"{glm_base_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert reply.status_code == 200, reply.text
    return glm_base_url


def _marks(block: Block) -> list[pytest.MarkDecorator]:
    return [pytest.mark.e2e] if DOCUMENTED_SERVER in block.body else []


@pytest.mark.parametrize("block", [pytest.param(b, marks=_marks(b), id=b.name) for b in RUN])
def test_each_bash_block_runs(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    script = block.body
    if DOCUMENTED_SERVER in script:
        server = request.getfixturevalue("documented_server")
        script = script.replace(DOCUMENTED_SERVER, server).replace(DOCUMENTED_MODEL, '"model": "tiny"')
    env = {**os.environ, "HOME": str(tmp_path)}  # a block writes nothing of the user's
    done = subprocess.run(
        ["bash", "-c", PREAMBLE + script], cwd=REPO, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
    )
    assert done.returncode == 0 and done.stdout.strip(), f"{block.name}:\n{script}\n{done.stdout}\n{done.stderr}"

"""The fenced blocks of README.md, cluster/README.md and docs/, read the way tests/e2e/test_doc_commands_e2e.py
runs them: a ```bash block runs unless the line above its fence says why it cannot,
`<!-- not run by the tests: REASON -->` (tests/app/test_docs.py checks the labels and the reasons)."""

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "cluster" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^([ \t]*)```(.*)$")
SKIP = re.compile(r"^<!-- not run by the tests: (.+) -->$")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # of its opening fence
    language: str  # the fence's info string
    body: str
    skip: str | None  # why it cannot run in the tests, from the line above its fence

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def is_bash(self) -> bool:
        return self.language.split(" ")[0] == "bash"


def page_blocks(page: Path) -> list[Block]:
    """The page's fenced blocks, each with the skip line just above its fence (indented fences too)."""
    found: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    opened: tuple[int, str] | None = None  # (line index, info string)
    for index, line in enumerate(lines):
        fence = FENCE.match(line)
        if fence is None:
            continue
        if opened is None:
            opened = (index, fence.group(2).strip())
            continue
        start, info = opened
        body = textwrap.dedent("\n".join(lines[start + 1 : index])) + "\n"
        skip = SKIP.match(lines[start - 1].strip()) if start else None
        found.append(Block(str(page.relative_to(REPO)), start + 1, info, body, skip.group(1) if skip else None))
        opened = None
    return found


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in page_blocks(page)]

"""docs/agents/instructor-langchain.md, run: each Python block against the session's tiny-glm app.

Each block runs in its own interpreter with only the server's address rewritten, and must print exactly
the `text` block the page shows under it (tiny-glm writes its scripted replies at temperature 0). It shares
the session's tiny-glm app (conftest.glm_base_url) with the other modules that use it.
"""

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e
PAGE = REPO / "docs" / "agents" / "instructor-langchain.md"
DOCS_URL = "http://127.0.0.1:8080"
EXAMPLE = re.compile(r"```python\n(.*?)```\s*```text\n(.*?)```", re.S)


def _examples() -> list[tuple[str, str]]:
    return EXAMPLE.findall(PAGE.read_text(encoding="utf-8"))


def test_the_page_shows_three_examples() -> None:
    assert len(_examples()) == 3


@pytest.mark.parametrize("index", range(3), ids=["reply", "tool-calls", "structured-output"])
def test_each_block_prints_what_the_page_shows(glm_base_url: str, index: int) -> None:
    code, printed = _examples()[index]
    done = subprocess.run(
        [sys.executable, "-c", code.replace(DOCS_URL, glm_base_url)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == printed

"""The docs cannot go stale silently: every repository path README.md and docs/*.md name exists (and every
module they name by its tail, `chat_run.py` or `openai/routes.py`, is some file's), every link between the
pages lands on a page and heading that exist, every docs page is linked from the README, the README stays a
front door (under README_MAX_LINES lines), and every fenced block names its language (the bash ones run in
tests/e2e/test_doc_commands_e2e.py)."""

import functools
import re
from pathlib import Path

import pytest

from tests.support.doc_blocks import all_blocks

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").rglob("*.md"))
PAGES = [REPO / "README.md", REPO / "cluster" / "README.md", *DOCS]
README_MAX_LINES = 220
CODE_FOLDERS = ("deployments", "serve_app", "kernels", "tests")
TOP_FOLDERS = sorted(entry.name for entry in REPO.iterdir() if entry.is_dir() and entry.name != ".git")
# A path starts at a top folder (not inside a longer path or a URL) and runs over path characters, `{a,b}`
# alternatives, `<name>` placeholders and `*` globs; `::` (a test's node id), spaces and punctuation end it.
PATH = re.compile(rf"(?<![\w./~-])(?:{'|'.join(map(re.escape, TOP_FOLDERS))})/(?:\{{[^}}\s]*\}}|[\w.*<>/-])*")
# A module named by its last parts: `sequence.py`, `openai/chat_reply.py` (full paths are PATH's).
MODULE = re.compile(r"(?<![\w./~<>-])[\w/]+\.py\b")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *$")


def expand_braces(text: str) -> list[str]:
    """`a/{b,c}.py` as `a/b.py` and `a/c.py` (every brace, in order)."""
    match = re.search(r"\{([^{}]*)\}", text)
    if match is None:
        return [text]
    head, tail = text[: match.start()], text[match.end() :]
    return [path for option in match.group(1).split(",") for path in expand_braces(head + option + tail)]


def named_paths(text: str) -> list[str]:
    """The repository paths a page names, braces expanded, as written otherwise (placeholders, globs)."""
    found = (match.group(0).rstrip(".") for match in PATH.finditer(text))
    return [path for written in found for path in expand_braces(written)]


def named_modules(text: str) -> list[str]:
    """The modules a page names by their last parts only."""
    return [name for name in MODULE.findall(text) if name.split("/")[0] not in TOP_FOLDERS]


@functools.cache
def modules() -> tuple[str, ...]:
    return tuple(path.relative_to(REPO).as_posix() for top in CODE_FOLDERS for path in (REPO / top).rglob("*.py"))


def is_a_module_tail(name: str) -> bool:
    """Some file of the code's folders is `name` or ends with `/name`."""
    return any(path.endswith("/" + name) for path in modules())


def exists(path: str) -> bool:
    """A file or folder; a `<placeholder>` or glob must match at least one."""
    pattern = re.sub(r"<[^>]*>", "*", path).rstrip("/")
    if any(char in pattern for char in "*?["):
        return any(REPO.glob(pattern))
    return (REPO / pattern).exists()


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor, numbered as GitHub numbers repeats; fenced code holds no headings."""
    found: set[str] = set()
    repeats: dict[str, int] = {}
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        fenced ^= line.startswith("```")
        heading = None if fenced else HEADING.match(line)
        if heading is not None:
            base = slug(heading.group(1))
            found.add(f"{base}-{repeats[base]}" if base in repeats else base)
            repeats[base] = repeats.get(base, 0) + 1
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            broken.append(target)
    return broken


def test_the_readme_is_a_front_door() -> None:
    lines = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move the detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_path_a_page_names_exists(page: Path) -> None:
    missing = sorted({path for path in named_paths(page.read_text(encoding="utf-8")) if not exists(path)})
    assert not missing, f"{page.relative_to(REPO)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_module_a_page_names_by_its_tail_exists(page: Path) -> None:
    missing = sorted({name for name in named_modules(page.read_text(encoding="utf-8")) if not is_a_module_tail(name)})
    assert not missing, f"{page.relative_to(REPO)} names modules no file is: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_link_lands(page: Path) -> None:
    assert not broken_links(page), f"{page.relative_to(REPO)} links nowhere: {broken_links(page)}"


def test_the_readme_links_every_docs_page() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    names = [page.relative_to(REPO / "docs").as_posix() for page in DOCS]
    unlinked = [name for name in names if f"](docs/{name}" not in readme]
    assert not unlinked, f"README.md's documentation list lacks {unlinked}"


def test_paths_are_read_as_written() -> None:
    text = (
        "See `deployments/ingress/{a,b}.py`, deployments/ingress/<family>/routes.py and "
        "`tests/rank/test_model_parity.py::test_x[qwen3-bfloat16]`. Not ~/.cache/serve_app/x, "
        "http://host/tests/y, ../shared/fixtures or logs/serve/; `kernels/cpu/*.c` is a glob."
    )
    assert named_paths(text) == [
        "deployments/ingress/a.py",
        "deployments/ingress/b.py",
        "deployments/ingress/<family>/routes.py",
        "tests/rank/test_model_parity.py",
        "kernels/cpu/*.c",
    ]
    assert exists("deployments/ingress/<family>/routes.py") and exists("kernels/cpu/*.c") and exists("tests/app/")
    assert not exists("deployments/ingress/<family>/nothing.py") and not exists("tests/nothing.py")
    named = named_modules("`chat_run.py`, openai/routes.py, `deployments/ingress/app.py`, models/<type>.py")
    assert named == ["chat_run.py", "openai/routes.py"]
    assert is_a_module_tail("openai/routes.py") and not is_a_module_tail("ingress/stream_hub.py")
    assert expand_braces("tests/{api,app}/{x,y}") == ["tests/api/x", "tests/api/y", "tests/app/x", "tests/app/y"]


def test_anchors_are_githubs() -> None:
    assert slug("2. One chat completion, in request order") == "2-one-chat-completion-in-request-order"
    assert slug("Routing: prefix affinity against Serve's default") == "routing-prefix-affinity-against-serves-default"
    assert slug("`--learn` alone") == "--learn-alone"


def test_every_fenced_block_names_its_language() -> None:
    """So no command slips out of tests/e2e/test_doc_commands_e2e.py unlabelled (```bash, ```text, ```yaml...)."""
    assert not [block.name for block in all_blocks() if not block.language]


def test_only_bash_blocks_say_why_the_tests_do_not_run_them() -> None:
    assert not [block.name for block in all_blocks() if block.skip is not None and not block.is_bash]


def test_no_block_the_tests_run_installs_packages() -> None:
    """An install run by tests/e2e/test_doc_commands_e2e.py would change the environment the rest of the run
    tests in (a `[cuda]` install swaps Triton's files under the kernel tests' loaded interpreter)."""
    installs = ("pip install", "pip3 install", "uv pip", "npm install", "apt-get install", "apt install")
    runs = [block for block in all_blocks() if block.is_bash and block.skip is None]
    assert not [block.name for block in runs if any(word in block.body for word in installs)]


def test_every_test_folder_is_named_in_the_readme_and_the_structure_page() -> None:
    folders = sorted(path.name for path in (REPO / "tests").iterdir() if path.is_dir() and path.name != "__pycache__")
    readme_row = next(line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `tests/`"))
    structure = (REPO / "docs" / "structure.md").read_text()
    assert [name for name in folders if f"`{name}`" not in readme_row] == []
    assert [name for name in folders if f"`tests/{name}/`" not in structure] == []

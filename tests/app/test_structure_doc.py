"""docs/structure.md's module list is the code's own: made from the docstrings, it cannot drift."""

import ast
import re

from tests.support.structure_doc import PAGE, REPO, folders, undescribed, with_list

REGENERATE = "run `python -m tests.support.structure_doc --write`"


def test_the_module_list_is_made_from_the_docstrings() -> None:
    page = PAGE.read_text()
    assert with_list(page) == page, f"docs/structure.md's module list disagrees with the docstrings; {REGENERATE}"


def test_every_source_file_and_package_opens_with_a_summary() -> None:
    assert undescribed() == [], "give each a docstring (a C file a leading // comment) whose first paragraph sums it up"


def test_the_files_a_package_docstring_names_exist() -> None:
    """A package's docstring that maps its files (`core.py`, `http/`) names files of that package."""
    stale = []
    for folder in folders():
        init = folder / "__init__.py"
        if not init.exists():
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for name in re.findall(r"(?<![\w./])([a-z_]+\.py)\b", doc):
            if not (folder / name).exists() and not list(folder.rglob(name)):
                stale.append(f"{init.relative_to(REPO)} names {name}")
    assert stale == []


def test_the_request_walks_trace_count_is_the_one_measured(served_model: str) -> None:
    """docs/structure.md's "One chat completion" states how many files one streamed chat runs code in."""
    from tests.support.request_trace import traced_files

    stated = re.search(r"over the real routes, renderer and engine, counts (\d+) files", PAGE.read_text())
    assert stated is not None
    files = traced_files(served_model)
    assert len(files) == int(stated.group(1)), "update docs/structure.md's count: " + ", ".join(files)

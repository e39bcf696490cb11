"""docs/structure.md's module list, generated from the code: each package's docstring introduces its folder,
each module's first docstring paragraph (a C source's first comment paragraph) says what it does.

Regenerate after adding, moving or re-describing a module: `python -m tests.support.structure_doc --write`
(tests/app/test_structure_doc.py fails while the page and the code disagree).
"""

import argparse
import ast
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "structure.md"
TOPS = ("deployments", "serve_app", "kernels")  # the order the page walks them: the layers, top to bottom
SOURCES = ("*.py", "*.c", "*.h")
BEGIN = "<!-- module list: generated from the docstrings by `python -m tests.support.structure_doc --write` -->"
END = "<!-- end of the module list -->"
WIDTH = 110
MAX_SUMMARY_CHARS = 330  # three lines of the page: a summary, not the module's whole story


def _first_paragraph(text: str) -> str:
    return " ".join(text.strip().split("\n\n")[0].split())


def summary(path: Path) -> str:
    """What a source file says it is: a module's first docstring paragraph, a C file's first comment's."""
    text = path.read_text()
    if path.suffix == ".py":
        return _first_paragraph(ast.get_docstring(ast.parse(text)) or "")
    lines = []
    for line in text.splitlines():  # the leading `//` comment block
        if not line.startswith("//"):
            break
        lines.append(line[2:].strip())
    return _first_paragraph("\n".join(lines))


def folders() -> list[Path]:
    """Every folder under the top packages that holds source files, each top's own first."""
    found = []
    for top in TOPS:
        holding = {path.parent for pattern in SOURCES for path in (REPO / top).rglob(pattern)}
        found += sorted(holding, key=lambda folder: folder.relative_to(REPO).parts)
    return [folder for folder in found if "__pycache__" not in folder.parts]


def modules(folder: Path) -> list[Path]:
    files = {path for pattern in SOURCES for path in folder.glob(pattern)}
    return sorted(path for path in files if path.name != "__init__.py")


def _bullet(path: Path) -> str:
    text = f"- `{path.relative_to(REPO).as_posix()}`: {summary(path)}"
    return textwrap.fill(text, WIDTH, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False)


def _folder_block(folder: Path) -> str:
    lines = [f"### `{folder.relative_to(REPO).as_posix()}/`"]
    package = folder / "__init__.py"
    intro = summary(package) if package.exists() else ""
    if intro:
        lines += ["", textwrap.fill(intro, WIDTH, break_on_hyphens=False, break_long_words=False)]
    bullets = [_bullet(path) for path in modules(folder)]
    if bullets:
        lines += ["", *bullets]
    return "\n".join(lines)


def module_list() -> str:
    return "\n\n".join(_folder_block(folder) for folder in folders())


def undescribed() -> list[str]:
    """Source files (and packages) with no summary, or one too long to be a summary."""
    found = []
    for folder in folders():
        for path in [*modules(folder), folder / "__init__.py"]:
            if not path.exists():
                continue
            text = summary(path)
            if not text or len(text) > MAX_SUMMARY_CHARS:
                found.append(f"{path.relative_to(REPO)} ({len(text)} characters)")
    return found


def with_list(page: str) -> str:
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{PAGE.name} lacks the module list's markers: {BEGIN} ... {END}")
    return page[: start + len(BEGIN)] + "\n\n" + module_list() + "\n\n" + page[end:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"put the list into {PAGE.relative_to(REPO)}")
    args = parser.parse_args()
    if args.write:
        PAGE.write_text(with_list(PAGE.read_text()))
        print(f"wrote the module list in {PAGE}")
    else:
        print(module_list())


if __name__ == "__main__":
    main()

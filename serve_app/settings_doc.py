"""docs/config.md's settings table, generated from the settings' declarations (serve_app/settings.py).

`tensorfold settings` prints the table; `tensorfold settings --write` puts it into docs/config.md between
the page's two markers, leaving the text around them as it is. tests/app/test_settings_doc.py names the
rows that differ when the page and the fields disagree.
"""

import argparse
from itertools import groupby
from pathlib import Path
from typing import Any

from serve_app.settings import Setting, settings, type_label, value_label

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "config.md"
BEGIN = "<!-- settings table: generated from the fields by `tensorfold settings --write`; edit those -->"
END = "<!-- end of the settings table -->"
HEADER = "| YAML key | flag | type | default | what it does |\n| --- | --- | --- | --- | --- |"
NEW_PAGE = f"# Settings\n\n{BEGIN}\n{END}\n"


def row(setting: Setting) -> str:
    """One setting's table row: its key, flag (if any), type, default and description."""
    flag = f"`{setting.flag_name}`" if setting.flag_name else ""
    if setting.flag.repeatable:
        flag += " (repeatable)"
    default = value_label(setting.default)
    if setting.flag.default is not None:
        default += f" (`tensorfold serve`: {setting.flag.default})"
    cells = [f"`{setting.key}`", flag, type_label(setting), default, setting.description]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def table() -> str:
    """Every setting, one table per section under its heading, in the order serve_app/settings.py gives."""
    parts = []
    for section, group in groupby(settings(), key=lambda setting: setting.section):
        parts.append(f"### {section}\n\n{HEADER}\n" + "\n".join(row(setting) for setting in group))
    return "\n\n".join(parts)


def with_table(page: str) -> str:
    """`page` with the text between its markers replaced by the table."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page lacks the settings table's markers: {BEGIN} ... {END}")
    return page[: start + len(BEGIN)] + "\n\n" + table() + "\n\n" + page[end:]


def disagreement(page: str) -> tuple[list[str], list[str]]:
    """(rows the fields give that the page lacks, rows the page has that the fields do not give)."""
    start, end = page.find(BEGIN), page.find(END)
    written = {line for line in page[start:end].splitlines() if line.startswith("| `")}
    wanted = [row(setting) for setting in settings()]
    return [line for line in wanted if line not in written], sorted(written - set(wanted))


def run(namespace: argparse.Namespace) -> int:
    if not namespace.write:
        print(table())
        return 0
    path = Path(namespace.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(with_table(path.read_text() if path.exists() else NEW_PAGE))
    print(f"tensorfold settings: wrote the table in {path}")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("settings", help="print the settings table (every YAML key and flag)")
    parser.add_argument("--write", action="store_true", help="put the table into docs/config.md instead")
    parser.add_argument("--path", default=str(DOC_PATH), help="the page --write updates (default docs/config.md)")
    parser.set_defaults(func=run)

"""docs/config.md's settings table is the one the fields give (regenerate: tensorfold settings --write)."""

from serve_app.settings import settings
from serve_app.settings_doc import BEGIN, DOC_PATH, END, NEW_PAGE, disagreement, row, with_table


def test_the_docs_table_is_the_fields() -> None:
    page = DOC_PATH.read_text()
    missing, stale = disagreement(page)
    assert not missing and not stale, (
        "docs/config.md's settings table disagrees with the fields; run `tensorfold settings --write`\n"
        + "".join(f"missing: {line}\n" for line in missing)
        + "".join(f"stale:   {line}\n" for line in stale)
    )
    assert with_table(page) == page, "docs/config.md's table is out of order; run `tensorfold settings --write`"


def test_a_changed_field_is_named_missing_and_its_old_row_stale() -> None:
    page = with_table(NEW_PAGE)
    host, port = (row(setting) for setting in settings() if setting.key in ("host", "port"))
    page = page.replace(port, port.replace("8080", "8081")).replace(host + "\n", "")
    missing, stale = disagreement(page)
    assert missing == [host, port]
    assert stale == [port.replace("8080", "8081")]


def test_writing_keeps_the_text_around_the_table() -> None:
    page = f"# Settings\n\nbefore\n\n{BEGIN}\nold rows\n{END}\n\nafter\n"
    written = with_table(page)
    assert written.startswith("# Settings\n\nbefore\n\n") and written.endswith(f"{END}\n\nafter\n")
    assert "old rows" not in written and disagreement(written) == ([], [])

"""Incremental detokenisation and stop strings, including matches that span tokens."""

from deployments.scheduler.engine.text_output import IncrementalText


def _decoder(pieces: dict[int, bytes]):
    return lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")


PIECES = {0: b"Hel", 1: b"lo", 2: b" wor", 3: b"ld", 4: b"\xe6\x9d", 5: b"\xb1", 6: b"!", 7: b"EN", 8: b"D"}


def _run(ids: list[int], stop: list[str]) -> tuple[list[str], IncrementalText]:
    text = IncrementalText(_decoder(PIECES), stop)
    deltas = []
    for token in ids:
        text.add_token(token)
        deltas.append(text.take_delta(final=False))
        if text.stopped_by:
            break
    deltas.append(text.take_delta(final=True))
    return deltas, text


def test_plain_text_streams_token_by_token() -> None:
    deltas, text = _run([0, 1, 2, 3], [])
    assert "".join(deltas) == "Hello world" and deltas[0] == "Hel"


def test_split_utf8_waits_for_its_continuation() -> None:
    deltas, _ = _run([0, 4, 5, 6], [])
    assert deltas[1] == "" and deltas[2] == "\u6771" and "".join(deltas) == "Hel\u6771!"


def test_stop_string_across_tokens_cuts_before_match() -> None:
    deltas, text = _run([0, 1, 2, 7, 8, 6], ["END"])
    assert text.stopped_by == "END"
    assert "".join(deltas) == "Hello wor"
    # Nothing of the stop string ever left early.
    assert all("E" not in d for d in deltas)


def test_held_text_is_released_when_no_stop_follows() -> None:
    deltas, text = _run([0, 7, 6], ["END"])
    assert text.stopped_by is None
    assert deltas[1] == "" and "".join(deltas) == "HelEN!"

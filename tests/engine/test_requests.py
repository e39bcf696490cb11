"""The one owner of a request's life in the engine (`Requests`), driven without a model: each change leaves
every table at once, the writer only reports a reply's end, and the tables are read-only views."""

import pytest

from deployments.messages.counters import EngineCounters
from deployments.messages.replies import FinishReason
from deployments.messages.requests import EngineRequest, Priority, SamplingParams
from deployments.messages.step import SeqStep, StepResult
from deployments.scheduler.engine.kv_blocks import BlockManager
from deployments.scheduler.engine.planner import Planner
from deployments.scheduler.engine.reply_writer import ReplyWriter
from deployments.scheduler.engine.requests import Finish, Requests
from deployments.scheduler.engine.sequence import SeqStatus, Sequence
from deployments.scheduler.engine.text_output import IncrementalText

END = 2  # the end token of these tests' replies


def _seq(name: str, prompt_len: int = 6, order: int = 0, priority: Priority = Priority.FOREGROUND) -> Sequence:
    request = EngineRequest(
        name, list(range(10, 10 + prompt_len)), SamplingParams(temperature=0.0), max_tokens=8, priority=priority
    )
    text = IncrementalText(lambda ids: "".join(chr(97 + i % 26) for i in ids), [])
    return Sequence(request, 0, 8, text, order, token_ids=list(request.prompt_token_ids))


def _engine_parts(blocks: int = 16, lanes: int = 4) -> tuple[Requests, Planner, BlockManager]:
    pool = BlockManager(blocks, 4)
    requests = Requests(pool, EngineCounters())
    return requests, Planner(requests, pool, lanes=lanes, chunk_size=64, decode_share=0.25), pool


def _tables(requests: Requests, seq: Sequence) -> tuple[bool, bool, bool]:
    """Whether `seq` is in flight, waiting, running."""
    return requests.get(seq.request_id) is seq, seq in requests.waiting, seq in requests.running


def test_an_admitted_request_waits_then_runs_holding_blocks() -> None:
    requests, planner, pool = _engine_parts()
    seq = _seq("a")
    requests.add(seq)
    assert _tables(requests, seq) == (True, True, False) and seq.status is SeqStatus.WAITING
    planned = planner.schedule()
    assert planned is not None and planned.seqs == [seq]
    assert _tables(requests, seq) == (True, False, True) and seq.status is SeqStatus.RUNNING
    assert pool.num_used == 2 and requests.has_work()


@pytest.mark.parametrize("reason", [FinishReason.STOP, FinishReason.LENGTH, FinishReason.ERROR])
def test_a_finished_request_leaves_every_table_at_once_and_frees_its_blocks(reason: FinishReason) -> None:
    requests, planner, pool = _engine_parts()
    seq, other = _seq("a"), _seq("b", order=1)
    requests.add(seq)
    requests.add(other)
    planner.schedule()
    requests.finish(seq, Finish(reason, "why" if reason is FinishReason.ERROR else None))
    assert _tables(requests, seq) == (False, False, False) and seq.status is SeqStatus.FINISHED
    assert seq.block_table.block_ids == [] and pool.num_used == 2  # the other request's blocks alone
    (last,) = requests.take_chunks()
    assert last.request_id == "a" and last.finish_reason is reason and last.stats is seq.stats
    assert last.error == ("why" if reason is FinishReason.ERROR else None)
    requests.finish(seq, Finish(FinishReason.ABORT))  # a second end is no change
    assert seq.finish_reason is reason and requests.take_chunks() == []


def test_an_aborted_request_leaves_every_table_whether_it_waited_or_ran() -> None:
    requests, planner, pool = _engine_parts(lanes=1)
    running, waiting = _seq("runs"), _seq("waits", order=1)
    requests.add(running)
    requests.add(waiting)
    planner.schedule()
    assert running in requests.running and waiting in requests.waiting  # one lane
    requests.abort("waits")
    requests.abort("runs")
    requests.abort("unknown")  # a caller that left after its reply ended: nothing to do
    assert _tables(requests, running) == _tables(requests, waiting) == (False, False, False)
    assert len(requests) == 0 and not requests.has_requests() and pool.num_used == 0
    assert [c.finish_reason for c in requests.take_chunks()] == [FinishReason.ABORT, FinishReason.ABORT]


def test_a_preempted_request_leaves_running_for_waiting_and_keeps_its_tokens() -> None:
    requests, planner, pool = _engine_parts(lanes=1)
    background = _seq("bg", priority=Priority.BACKGROUND)
    requests.add(background)
    planner.schedule()
    background.token_ids.append(5)  # a reply token it keeps
    foreground = _seq("fg", order=1)
    requests.add(foreground)
    planned = planner.schedule()  # the foreground request takes the background one's lane
    assert planned is not None and planned.seqs == [foreground]
    assert _tables(requests, background) == (True, True, False) and background.status is SeqStatus.WAITING
    assert background.num_computed == 0 and background.token_ids[-1] == 5 and background.block_table.block_ids == []
    assert background.stats.preemptions == 1 and requests.counters.preemptions_total == 1


def test_abort_all_ends_every_request_and_drops_the_chunks_not_taken() -> None:
    requests, planner, pool = _engine_parts(lanes=1)
    for i in range(3):
        requests.add(_seq(f"r{i}", order=i))
    planner.schedule()
    requests.abort_all("internal engine error")
    assert len(requests) == 0 and not requests.has_work() and pool.num_used == 0
    assert requests.take_chunks() == []  # the transport ends their streams with the failure


def test_a_request_id_in_flight_is_refused() -> None:
    requests, _, _ = _engine_parts()
    requests.add(_seq("a"))
    with pytest.raises(ValueError, match="already running"):
        requests.add(_seq("a"))


def test_the_tables_are_read_only_views() -> None:
    requests, _, _ = _engine_parts()
    seq = _seq("a")
    requests.add(seq)
    view = requests.waiting
    assert isinstance(view, tuple) and isinstance(requests.running, tuple)
    with pytest.raises(AttributeError):
        view.remove(seq)  # type: ignore[attr-defined]
    requests.start(seq)
    assert view == (seq,) and requests.waiting == ()  # a view is a snapshot: only the owner changes the tables


def test_the_writer_reports_a_replys_end_and_changes_no_table() -> None:
    requests, planner, _ = _engine_parts()
    seq = _seq("a")
    requests.add(seq)
    planned = planner.schedule()
    assert planned is not None
    writer = ReplyWriter({END}, requests.counters)
    step = SeqStep(new_token_ids=seq.token_ids[:], num_computed=0, block_ids=[])
    goes_on = writer.accept_run(seq, step, [StepResult(7)], now=1.0)
    assert goes_on.finish is None and goes_on.kept == 0 and seq.reply_token_ids == [7]
    ends = writer.accept_run(seq, step, [StepResult(END)], now=2.0)
    assert ends.finish == Finish(FinishReason.STOP) and seq.reply_token_ids == [7, END]
    assert seq.finish_reason is None and _tables(requests, seq) == (True, False, True)  # still the owner's
    requests.wrote(seq, ends.finish)
    assert seq.finish_reason is FinishReason.STOP and _tables(requests, seq) == (False, False, False)
    assert requests.take_chunks()[-1].token_ids == [7, END]

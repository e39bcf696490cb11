"""The scheduling policy, driven step by step without a model."""

from deployments.messages.counters import EngineCounters
from deployments.messages.requests import EngineRequest, Priority
from deployments.scheduler.engine.kv_blocks import BlockManager
from deployments.scheduler.engine.planner import PASSED_OVER_LIMIT, PlannedStep, Planner
from deployments.scheduler.engine.requests import Requests
from deployments.scheduler.engine.sequence import Sequence
from deployments.scheduler.engine.text_output import IncrementalText

_order = iter(range(10**6))


def _seq(prompt_len: int, priority: Priority = Priority.FOREGROUND, name: str = "") -> Sequence:
    request = EngineRequest(
        request_id=name or f"r{prompt_len}", prompt_token_ids=list(range(1, prompt_len + 1)), priority=priority
    )
    return Sequence(
        request=request,
        seed=0,
        max_tokens=100,
        text=IncrementalText(lambda ids: "", []),
        arrival_order=next(_order),
        token_ids=list(request.prompt_token_ids),
    )


def _complete(planner: Planner, planned: PlannedStep, seconds: float = 1.0) -> None:
    """What the engine does after a step: count computed tokens and append a drawn token."""
    for seq, step in zip(planned.seqs, planned.plan.seqs):
        seq.num_computed += len(step.new_token_ids)
        if step.draw is not None:
            seq.token_ids.append(7)
    planner.record(planned, seconds)


def _planner(chunk: int = 8, share: float = 0.25, blocks: int = 64, lanes: int = 8) -> Planner:
    """A planner over its own requests' owner (`planner.requests`) and block pool."""
    pool = BlockManager(blocks, 4)
    return Planner(Requests(pool, EngineCounters()), pool, lanes=lanes, chunk_size=chunk, decode_share=share)


def test_chunk_goes_to_fewest_tokens_left_and_foreground_first() -> None:
    planner = _planner(chunk=4)
    long, short, background = _seq(20, name="long"), _seq(6, name="short"), _seq(2, Priority.BACKGROUND, "bg")
    for s in (long, short, background):
        planner.requests.add(s)
    first = planner.schedule()
    assert first is not None and first.seqs[0] is short  # fewest tokens left among foreground prompts
    assert background not in first.seqs  # the chunk was full before the background prompt's turn


def test_passed_over_prompt_takes_the_next_chunk() -> None:
    planner = _planner(chunk=4)
    long = _seq(200, name="long")
    planner.requests.add(long)
    starved_after = None
    for i in range(PASSED_OVER_LIMIT + 2):
        planner.requests.add(_seq(8, name=f"short{i}"))  # a stream of short prompts keeps arriving
        planned = planner.schedule()
        if long in planned.seqs:
            starved_after = i
            break
        _complete(planner, planned, seconds=0.0)
    assert starved_after == PASSED_OVER_LIMIT


def test_decode_rounds_take_their_share_between_chunks() -> None:
    planner = _planner(chunk=4, share=0.25)
    a = _seq(4, name="a")
    planner.requests.add(a)
    _complete(planner, planner.schedule())  # a's whole prompt: it now decodes
    b = _seq(40, name="b")
    planner.requests.add(b)
    kinds = []
    for _ in range(6):
        planned = planner.schedule()
        kinds.append(planned.plan.kind)
        _complete(planner, planned, seconds=1.0 if planned.plan.kind == "prefill" else 0.125)
    # Each 1 s chunk (a's prompt first) buys 0.25 s of rounds: two 0.125 s rounds.
    assert kinds == ["decode", "decode", "prefill", "decode", "decode", "prefill"]


def test_zero_share_prefills_whole_prompts_in_arrival_order() -> None:
    planner = _planner(chunk=4, share=0.0)
    a, b = _seq(4, name="a"), _seq(9, name="b")
    planner.requests.add(a)
    _complete(planner, planner.schedule())
    planner.requests.add(b)
    c = _seq(2, name="c")
    planner.requests.add(c)
    kinds = []
    order = []
    for _ in range(4):
        planned = planner.schedule()
        kinds.append(planned.plan.kind)
        order.extend(s.request_id for s in planned.seqs if planned.plan.kind == "prefill")
        _complete(planner, planned)
    assert kinds[:3] == ["prefill"] * 3 and kinds[3] == "decode"
    assert order[:3] == ["b", "b", "b"]  # arrival order, not fewest tokens first


def test_preemption_when_blocks_run_out_keeps_tokens() -> None:
    planner = _planner(chunk=64, blocks=4, lanes=4)  # 16 token slots
    first, second = _seq(7, name="first"), _seq(7, name="second")
    planner.requests.add(first)
    planner.requests.add(second)
    _complete(planner, planner.schedule())  # both prompts in one chunk, 4 blocks used
    for _ in range(2):  # both grow past their second block
        planned = planner.schedule()
        _complete(planner, planned)
    assert second.stats.preemptions == 1 and second in planner.requests.waiting
    assert second.num_computed == 0 and len(second.token_ids) > 7  # its reply tokens are kept


def test_foreground_takes_a_background_lane() -> None:
    planner = _planner(lanes=1)
    background = _seq(4, Priority.BACKGROUND, "bg")
    planner.requests.add(background)
    _complete(planner, planner.schedule())
    foreground = _seq(4, name="fg")
    planner.requests.add(foreground)
    planned = planner.schedule()
    assert planned.seqs == [foreground] and background in planner.requests.waiting

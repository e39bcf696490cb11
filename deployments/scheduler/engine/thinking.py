"""Thinking budget and loop guard: which tokens the engine writes instead of a drawn one.

Both decisions are pure functions of the reply so far and the drawn token, so drafted, serial, batched and
preempted decoding write the same reply. A forced close replaces the drawn token with "\\n</think>\\n\\n"
(`ThinkingControls.close_ids`) and the answer continues after it.

- Budget: the reply's budget-th token, drawn while the block is still open, is replaced.
- Loop guard: inside an open block, when the drawn token completes LOOP_MATCHES consecutive tokens that
  each equal the token `period` before them (period <= MAX_PERIOD, the smallest such), and that repeated
  region starts at least LOOP_START reply tokens in, the drawn token is replaced.
"""

from dataclasses import dataclass

from deployments.messages.requests import ThinkingControls

MAX_PERIOD = 8
LOOP_MATCHES = 256
LOOP_START = 64


@dataclass
class Forced:
    token_ids: list[int]  # written instead of the drawn token
    loop_period: int | None = None  # set when the loop guard fired


def thinking_open(reply: list[int], controls: ThinkingControls) -> bool:
    """Whether the reply so far is inside an open think block."""
    if controls.closer_id is None:
        return False
    opened = controls.prompt_opens or (bool(reply) and reply[0] == controls.opener_id)
    return opened and controls.closer_id not in reply


def loop_period(reply: list[int], token: int) -> int | None:
    """The smallest period <= MAX_PERIOD whose run of predecessor matches, ending at `token`, reaches
    LOOP_MATCHES with the repeated region starting at least LOOP_START tokens into the reply."""
    position = len(reply)  # where `token` would go
    for period in range(1, MAX_PERIOD + 1):
        first = position - LOOP_MATCHES + 1  # the earliest position whose match the run needs
        if first - period < LOOP_START:
            continue
        if reply[position - period] != token:
            continue
        if all(reply[i] == reply[i - period] for i in range(first, position)):
            return period
    return None


def force_tokens(reply: list[int], token: int, controls: ThinkingControls | None) -> Forced | None:
    """What to write instead of `token` (drawn after `reply`), or None to keep it."""
    if controls is None or not controls.close_ids or token == controls.closer_id:
        return None
    if not (controls.budget > 0 or controls.loop_guard) or not thinking_open(reply, controls):
        return None
    if controls.budget > 0 and len(reply) + 1 == controls.budget:
        return Forced(list(controls.close_ids))
    if controls.loop_guard:
        period = loop_period(reply, token)
        if period is not None:
            return Forced(list(controls.close_ids), loop_period=period)
    return None

"""A learn or a delete that holds the lock: what its steps share, and how a failure ends it.

Everything that can refuse a change (its body, the pocket's room, a question past the window, the lock) is
settled before the first event (deployments/slide/room.py); from then on a fact that cannot be learned is a
`failed` event, and an unexpected failure an `error` event, never a broken server.
"""

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from deployments.messages.slide_changes import ErrorEvent
from deployments.slide.checks import Question
from deployments.slide.context import SlideContext, SlideRefused
from deployments.slide.engine import SlideEngine

log = logging.getLogger("tensorfold.slide")
_BACKGROUND: set[asyncio.Task[None]] = set()  # strong references to clean-ups in flight


@dataclass
class Change:
    """A learn or delete that holds the lock: who holds it, and what every step needs."""

    ctx: SlideContext
    engine: SlideEngine
    owner: str  # the request id: the lock's owner
    what: str  # what GET /v1/slide/graph's `busy` and a refused change's 503 say is running
    learned: list[Question] = field(default_factory=list)  # every learned fact's questions (kept answering)


async def shielded(work: Coroutine[Any, Any, None]) -> None:
    """`work` runs to its end even while the change that started it is being cancelled."""
    task = asyncio.get_running_loop().create_task(work)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    await asyncio.shield(task)


def error_event(exc: Exception) -> ErrorEvent:
    if isinstance(exc, SlideRefused):
        return ErrorEvent(exc.message)
    log.error("a living-weights change failed", exc_info=exc)
    return ErrorEvent("the change failed on the server (logged); GET /v1/slide/graph shows each fact")

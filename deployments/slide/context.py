"""What every step of a change shares: the links into the graph, the slide settings, the window; and how
the room refuses a change (a `Refusal`, answered by the route in its own format before any event)."""

from dataclasses import dataclass, field

from deployments.config import SlideSettings
from deployments.messages.replies import Refusal
from deployments.slide.links import SlideLinks

NOT_SERVING = "the model is not serving: no Scheduler replica answered"


class SlideRefused(Exception):
    """A change refused before its first event (its route answers the refusal), or, raised later, the
    message its `error` event shows."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal

    @property
    def message(self) -> str:
        return self.refusal.message


def bad_request(message: str, param: str | None = None, code: str | None = None) -> SlideRefused:
    return SlideRefused(Refusal(message, param, code))


def not_serving() -> SlideRefused:
    return SlideRefused(Refusal(NOT_SERVING, status=503, type="server_error"))


@dataclass
class SlideContext:
    links: SlideLinks
    settings: SlideSettings  # the steps, margin and learning rate a fact trains with
    _window: int | None = field(default=None, init=False)

    async def window(self) -> int:
        """The engine's window, read once from a Scheduler replica (503 while none answers)."""
        if self._window is None:
            replicas = await self.links.replicas()
            if not replicas:
                raise not_serving()
            self._window = replicas[0].window
        return self._window

"""What every route of one Ingress replica shares: the backend, the served names, and engine facts."""

from dataclasses import dataclass

from deployments.config import IngressSettings
from deployments.ingress.backend import Backend
from deployments.ingress.http.drain import Drain
from deployments.ingress.http.errors import APIError
from deployments.ingress.readiness import Readiness
from deployments.messages.replies import Refusal
from deployments.messages.status import ReplicaStatus
from deployments.messages.window import counts_messages_first, measures_text_first, messages_past_window


@dataclass
class EngineFacts:
    """What does not change while a model is served; read once from a Scheduler replica."""

    window: int
    engine: str  # the runtime block's `engine`


class ServingContext:
    def __init__(self, backend: Backend, settings: IngressSettings, drain: Drain | None = None) -> None:
        self.backend = backend
        self.settings = settings
        self.drain = drain if drain is not None else Drain()  # a planned stop (http/drain.py)
        self.readiness = Readiness(backend)
        self._facts: EngineFacts | None = None

    async def facts(self) -> EngineFacts:
        """The engine's facts. While the model loads this waits for it, up to `ready_wait_s`; then, or when no
        Scheduler replica answers at all (gone), an HTTP 503."""
        if self._facts is None:
            replicas = await self.readiness.wait(self.settings.ready_wait_s)  # each caller keeps its own deadline
            if not replicas:
                raise APIError(
                    503,
                    f"the model is not ready: no Scheduler replica answered within {self.settings.ready_wait_s:g} s",
                    "server_error",
                )
            self._facts = self._facts_of(replicas[0])
        return self._facts

    async def window_for(self, chars: int) -> int | None:
        """The window to refuse an input of `chars` characters against before it is tokenised: for a large
        input, waited for as `facts` waits; for a small one only if known (it tokenises quickly anyway, and
        a malformed one is refused at once while the model loads)."""
        if self._facts is None and not measures_text_first(chars):
            return None
        return (await self.facts()).window

    async def messages_past_window(self, messages: list[object] | None) -> Refusal | None:
        """A conversation with more messages than the window has tokens, refused before it is rendered (only a
        long one asks for the window: rendering 10^5 messages takes seconds of CPU, a short one none)."""
        count = len(messages or [])
        if not counts_messages_first(count):
            return None
        return messages_past_window(count, (await self.facts()).window, "messages")

    def _facts_of(self, first: ReplicaStatus) -> EngineFacts:
        label = f"tensorfold {self.settings.version} {first.model_type} {first.dtype} {first.device}"
        return EngineFacts(window=first.window, engine=label)

"""What every route of one Ingress replica shares: the backend, the served names, and engine facts."""

from dataclasses import dataclass

from deployments.chat_format.render_lanes import LARGE_CHARS
from deployments.config import IngressSettings
from deployments.ingress.backend import Backend
from deployments.ingress.http.errors import APIError
from deployments.ingress.readiness import Readiness
from deployments.messages.status import ReplicaStatus


@dataclass
class EngineFacts:
    """What does not change while a model is served; read once from a Scheduler replica."""

    window: int
    engine: str  # the runtime block's `engine`


class ServingContext:
    def __init__(self, backend: Backend, settings: IngressSettings) -> None:
        self.backend = backend
        self.settings = settings
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
        if self._facts is None and chars < LARGE_CHARS:
            return None
        return (await self.facts()).window

    def _facts_of(self, first: ReplicaStatus) -> EngineFacts:
        label = f"tensorfold {self.settings.version} {first.model_type} {first.dtype} {first.device}"
        return EngineFacts(window=first.window, engine=label)

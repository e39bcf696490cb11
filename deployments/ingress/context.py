"""What every route of one Ingress replica shares: the backend, the served names, and engine facts."""

from dataclasses import dataclass
from importlib import metadata

from pydantic import BaseModel, ConfigDict, Field

from deployments.ingress.backend import Backend
from deployments.ingress.http.errors import APIError
from deployments.ingress.http.keys import AuthSettings
from deployments.ingress.http.limits import DEFAULT_MAX_BODY_BYTES
from deployments.ingress.readiness import Readiness
from deployments.messages.status import ReplicaStatus

DEFAULT_READY_WAIT_S = 60.0


def package_version() -> str:
    try:
        return metadata.version("tensorfold")
    except metadata.PackageNotFoundError:  # running from a checkout without an install
        return "0.0.0+source"


class IngressSettings(BaseModel):
    """Set by the app builder from AppArgs."""

    model_config = ConfigDict(extra="forbid")

    served_name: str
    model_ids: list[str]  # the served name, then each alias
    thinking_budget: int = 0  # --thinking-budget: requests with an absent or zero budget get it
    loop_guard: bool = False  # --loop-guard: requests carry it to the engine
    version: str = package_version()
    auth: AuthSettings = AuthSettings()  # key digests and the key file; no keys: every route open
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies are refused with 413
    dashboard: bool = False  # serve /dashboard and /stats (404 when off)
    ready_wait_s: float = Field(default=DEFAULT_READY_WAIT_S, ge=0.0)  # a request sent while the model loads waits
    learn_conversations: bool = False  # the disk prompt-state store is on: the imprint routes answer


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
                raise APIError(503, f"the model is not ready: no Scheduler replica answered within "
                                    f"{self.settings.ready_wait_s:g} s", "server_error")  # fmt: skip
            self._facts = self._facts_of(replicas[0])
        return self._facts

    def _facts_of(self, first: ReplicaStatus) -> EngineFacts:
        label = f"tensorfold {self.settings.version} {first.model_type} {first.dtype} {first.device}"
        return EngineFacts(window=first.window, engine=label)

"""What every route of one Ingress replica shares: the backend, the served names, and engine facts."""

import asyncio
from dataclasses import dataclass
from importlib import metadata

from pydantic import BaseModel, ConfigDict

from deployments.ingress.backend import Backend
from deployments.ingress.errors import APIError
from deployments.ingress.keys import AuthSettings
from deployments.ingress.limits import DEFAULT_MAX_BODY_BYTES


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


@dataclass
class EngineFacts:
    """What does not change while a model is served; read once from a Scheduler replica."""

    window: int
    engine: str  # the runtime block's `engine`


class ServingContext:
    def __init__(self, backend: Backend, settings: IngressSettings) -> None:
        self.backend = backend
        self.settings = settings
        self._facts: EngineFacts | None = None
        self._facts_lock = asyncio.Lock()

    async def facts(self) -> EngineFacts:
        """The engine's facts; an HTTP 503 while no Scheduler replica answers (still starting, or gone)."""
        if self._facts is None:
            async with self._facts_lock:
                if self._facts is None:
                    self._facts = await self._read_facts()
        return self._facts

    async def _read_facts(self) -> EngineFacts:
        replicas = await self.backend.replicas()
        if not replicas:
            raise APIError(503, "the model is not ready: no Scheduler replica answered", "server_error")
        first = replicas[0]
        label = f"tensorfold {self.settings.version} {first.model_type} {first.dtype} {first.device}"
        return EngineFacts(window=first.window, engine=label)

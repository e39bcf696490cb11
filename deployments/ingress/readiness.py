"""Whether the engine can answer yet, as the Ingress replica sees it.

The Ingress replica starts answering HTTP while the Scheduler replica may still be loading its model (the
replicas start together, and loading takes longer). The engine is ready once a Scheduler replica answers
its status call; until then /health answers 503 "loading", /v1/models lists no model, and generation
requests wait for it (bounded). Concurrent callers share one status call at a time, so a crowd of
requests arriving during the load costs the Scheduler replicas one broadcast per poll, not one each.
"""

import asyncio
import time

from deployments.ingress.backend import Backend
from deployments.messages.status import ReplicaStatus

POLL_S = 0.2  # between status calls while waiting: a request starts within this of the engine's readiness


class Readiness:
    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.ready = False  # set once a Scheduler replica has answered; it stays set (a lost replica is an error)
        self._probe: asyncio.Future[list[ReplicaStatus]] | None = None

    async def probe(self) -> list[ReplicaStatus]:
        """Every Scheduler replica's status now ([]: none answered), sharing a status call in flight."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._backend.replicas())
        replicas = await asyncio.shield(self._probe)  # a caller that leaves does not cancel the others' call
        if replicas:
            self.ready = True
        return replicas

    async def wait(self, timeout_s: float) -> list[ReplicaStatus]:
        """The replicas' statuses as soon as one answers, or [] once `timeout_s` has passed without one."""
        deadline = time.monotonic() + timeout_s
        while True:
            replicas = await self.probe()
            left = deadline - time.monotonic()
            if replicas or left <= 0:
                return replicas
            await asyncio.sleep(min(POLL_S, left))

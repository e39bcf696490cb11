"""The engine calls of a learn or a delete (`SlideCall`), spoken to every Scheduler replica at once.

Every replica holds the same pocket versions and the same graph, so a call that changes them goes to all
of them and their answers must agree; training runs on one replica (the first by name) and its result is
staged on all. The learn/delete lock is held on every replica by one owner, or on none.
"""

from dataclasses import dataclass

from deployments.ingress.backend import Backend
from deployments.ingress.http.errors import APIError
from deployments.messages.slide import (
    PocketPatch,
    SlideCall,
    SlideFact,
    SlideGraph,
    SlideQuestion,
    TrainJob,
    TrainProgress,
)

RETRY_AFTER_S = 5  # a learn or a delete usually ends within seconds


class SlideBusy(APIError):
    """503: a learn or delete holds the lock (the reply carries Retry-After)."""

    def __init__(self, running: str) -> None:
        message = f"a living-weights change is running ({running}); send this again when it ends"
        super().__init__(503, message, "server_error", None, "slide_busy")

    def response(self):  # type: ignore[no-untyped-def]
        reply = super().response()
        reply.headers["Retry-After"] = str(RETRY_AFTER_S)
        return reply


@dataclass
class SlideEngine:
    """Ingress's side of the slide calls (docs/slide.md): each method is one `SlideCall`."""

    backend: Backend

    async def _all(self, name: str, *args: object) -> list[object]:
        answers = await self.backend.slide(SlideCall(name, tuple(args)))
        if not answers:
            raise APIError(503, "the model is not serving: no Scheduler replica answered", "server_error")
        return answers

    async def _one(self, name: str, replica: str, *args: object) -> object:
        answers = await self.backend.slide(SlideCall(name, tuple(args), replica))
        if not answers:
            raise RuntimeError(f"the Scheduler replica {replica} did not answer the slide call {name}")
        return answers[0]

    async def trainer(self) -> str:
        """The replica that trains (and zeroes): the first by name."""
        names = sorted(status.replica for status in await self.backend.replicas())
        if not names:
            raise APIError(503, "the model is not serving: no Scheduler replica answered", "server_error")
        return names[0]

    async def graph(self) -> SlideGraph:
        answer = (await self._all("graph"))[0]
        assert isinstance(answer, SlideGraph)
        return answer

    async def begin(self, owner: str, what: str) -> None:
        """Take (or renew) the lock on every replica; SlideBusy when any holds it for another change."""
        answers = await self._all("begin", owner, what)
        refused = next((a for a in answers if a), "")
        if refused:
            if len(answers) > len([a for a in answers if a]):
                await self.end(owner)  # the replicas that said yes let go again
            raise SlideBusy(str(refused))

    async def end(self, owner: str) -> None:
        await self._all("end", owner)

    async def add_fact(self, text: str, questions: list[SlideQuestion]) -> SlideFact | str:
        """The fact as every replica added it, or why not (the pocket is full)."""
        answers = await self._all("add_fact", text, questions)
        refused = next((a for a in answers if isinstance(a, str)), None)
        if refused is not None:
            return refused
        first = answers[0]
        assert isinstance(first, SlideFact)
        if any(not isinstance(a, SlideFact) or a.id != first.id or a.neurons != first.neurons for a in answers):
            raise RuntimeError("the Scheduler replicas added the fact with different ids or neurons")
        return first

    async def train(self, job: TrainJob, replica: str) -> TrainProgress:
        progress = await self._one("train", replica, job)
        assert isinstance(progress, TrainProgress)
        return progress

    async def stage(self, patch: PocketPatch) -> int:
        versions = await self._all("stage", patch)
        if len(set(versions)) != 1:
            raise RuntimeError(f"the Scheduler replicas staged different versions: {versions}")
        return int(versions[0])  # type: ignore[call-overload]

    async def commit(self, version: int, fact: int, state: str, reason: str | None) -> bool:
        """True when every replica made `version` current and wrote its shards and graph file."""
        return all(answer is True for answer in await self._all("commit", version, fact, state, reason))

    async def drop(self, version: int) -> None:
        await self._all("drop", version)

    async def set_state(self, fact: int, state: str, reason: str | None) -> SlideFact | None:
        answer = (await self._all("set_state", fact, state, reason))[0]
        return answer if isinstance(answer, SlideFact) else None

    async def zero(self, fact: int, replica: str) -> PocketPatch:
        patch = await self._one("zero", replica, fact)
        assert isinstance(patch, PocketPatch)
        return patch

    async def clear_graph(self) -> int:
        return int((await self._all("clear_graph"))[0])  # type: ignore[call-overload]

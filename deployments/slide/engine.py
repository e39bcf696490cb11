"""The typed engine calls of a learn or a delete (`SlideCall`, messages/slide.py), spoken to every Scheduler
replica at once.

Every replica holds the same pocket versions and the same graph, so a call that changes them goes to all
of them and their answers must agree; training runs on one replica (the first by name) and its result is
staged on all. The learn/delete lock is held on every replica by one owner, or on none.
"""

from dataclasses import dataclass

from deployments.messages.calls import Reply
from deployments.messages.replies import Refusal
from deployments.messages.slide import (
    AddFact,
    BeginChange,
    ClearGraph,
    CommitVersion,
    DropVersion,
    EndChange,
    PocketPatch,
    ReadGraph,
    SetFactState,
    SlideCall,
    SlideFact,
    SlideGraph,
    SlideQuestion,
    StageVersion,
    TrainFact,
    TrainJob,
    TrainProgress,
    ZeroFact,
)
from deployments.messages.slide_changes import BUSY_CODE
from deployments.slide.context import SlideRefused, not_serving
from deployments.slide.links import SlideLinks


def busy(running: str) -> SlideRefused:
    """503: a learn or delete holds the lock (the route adds Retry-After)."""
    message = f"a living-weights change is running ({running}); send this again when it ends"
    return SlideRefused(Refusal(message, status=503, type="server_error", code=BUSY_CODE))


@dataclass
class SlideEngine:
    """The room's side of the slide calls (docs/slide.md): each method is one typed `SlideCall`."""

    links: SlideLinks

    async def _all(self, call: SlideCall[Reply]) -> list[Reply]:
        answers = await self.links.slide(call)
        if not answers:
            raise not_serving()
        return answers

    async def _one(self, call: SlideCall[Reply]) -> Reply:
        answers = await self.links.slide(call)
        if not answers:
            raise RuntimeError(f"the Scheduler replica {call.replica} did not answer {type(call).__name__}")
        return answers[0]

    async def trainer(self) -> str:
        """The replica that trains (and zeroes): the first by name."""
        names = sorted(status.replica for status in await self.links.replicas())
        if not names:
            raise not_serving()
        return names[0]

    async def graph(self) -> SlideGraph:
        return (await self._all(ReadGraph()))[0]

    async def begin(self, owner: str, what: str) -> None:
        """Take (or renew) the lock on every replica; refused (busy) when any holds it for another change."""
        answers = await self._all(BeginChange(owner, what))
        refused = next((a for a in answers if a), "")
        if refused:
            if len(answers) > len([a for a in answers if a]):
                await self.end(owner)  # the replicas that said yes let go again
            raise busy(refused)

    async def end(self, owner: str) -> None:
        await self._all(EndChange(owner))

    async def add_fact(self, text: str, questions: list[SlideQuestion]) -> SlideFact | str:
        """The fact as every replica added it, or why not (the pocket is full)."""
        answers = await self._all(AddFact(text, questions))
        refused = next((a for a in answers if isinstance(a, str)), None)
        if refused is not None:
            return refused
        first = answers[0]
        assert isinstance(first, SlideFact)
        if any(not isinstance(a, SlideFact) or a.id != first.id or a.neurons != first.neurons for a in answers):
            raise RuntimeError("the Scheduler replicas added the fact with different ids or neurons")
        return first

    async def train(self, job: TrainJob, replica: str) -> TrainProgress:
        return await self._one(TrainFact(job, replica=replica))

    async def stage(self, patch: PocketPatch) -> int:
        versions = await self._all(StageVersion(patch))
        if len(set(versions)) != 1:
            raise RuntimeError(f"the Scheduler replicas staged different versions: {versions}")
        return versions[0]

    async def commit(self, version: int, fact: int, state: str, reason: str | None) -> bool:
        """True when every replica made `version` current and wrote its shards and graph file."""
        answers = await self._all(CommitVersion(version, fact, state, reason))
        return all(answers)

    async def drop(self, version: int) -> None:
        await self._all(DropVersion(version))

    async def set_state(self, fact: int, state: str, reason: str | None) -> SlideFact | None:
        return (await self._all(SetFactState(fact, state, reason)))[0]

    async def zero(self, fact: int, replica: str) -> PocketPatch:
        return await self._one(ZeroFact(fact, replica=replica))

    async def clear_graph(self) -> int:
        return (await self._all(ClearGraph()))[0]

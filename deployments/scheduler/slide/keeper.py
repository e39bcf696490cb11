"""The engine's living weights (docs/slide.md): the pocket's versions, the fact graph, the files, the one
learn or delete running, and the training run; `answer` answers the Slide room's typed `SlideCall`s.

Versions: 0 is the empty pocket. Training reserves the next number; `stage` puts a version on the ranks;
`commit` makes it current (new requests use it) and writes it. A version stays on the ranks while it is
current, staged, or used by a request still running.
"""

import copy
import logging
import time
from collections.abc import Callable
from typing import Any

from deployments.config import EngineConfig, StartupError
from deployments.messages.replies import Refusal
from deployments.messages.requests import EngineRequest
from deployments.messages.slide import (
    AddFact,
    BeginChange,
    ClearGraph,
    CommitVersion,
    DropVersion,
    EndChange,
    KeepVersions,
    PocketFigures,
    PocketPatch,
    ReadGraph,
    SetFactState,
    SlideCall,
    SlideFact,
    SlideGraph,
    SlideQuestion,
    StagePocket,
    StageVersion,
    TrainFact,
    TrainJob,
    TrainProgress,
    ZeroFact,
)
from deployments.model_rank.executor import Executor
from deployments.scheduler.slide.files import PocketFiles, pocket_folder
from deployments.scheduler.slide.graph import FactGraph
from deployments.scheduler.slide.host_pocket import HostPocket
from deployments.scheduler.slide.training import TrainRun

log = logging.getLogger("tensorfold.engine")
LEASE_S = 600.0  # a learn or delete whose caller went silent this long no longer holds the lock


class SlideKeeper:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        hidden: int,
        layers: int,
        add: Callable[[EngineRequest], Refusal | None],
    ) -> None:
        """`add` admits the engine's own capture requests."""
        self.executor, self.layer, self._add = executor, layers - 1, add
        self.fact_graph = FactGraph(config.slide_neurons, config.slide_capacity)
        self.files = PocketFiles(pocket_folder(config.slide_dir, config.model, config.dtype))
        self.host = HostPocket.zeros(config.pocket_neurons, hidden)
        self.current = self.newest = 0
        self.staged: dict[int, HostPocket] = {}
        self.on_ranks = {0}
        self.owner, self.what, self.lease_until = "", "", 0.0
        self.run: TrainRun | None = None
        self._open()

    # ---- startup ----------------------------------------------------------------------------------------
    def _open(self) -> None:
        """Serve what the files hold; a fact a stop caught learning is rolled back (its neurons zeroed)."""
        stored = self.files.read_pocket()
        if stored is not None:
            pocket, version = stored
            if pocket.shape != self.host.shape:
                raise StartupError(
                    f"the pocket in {self.files.folder} holds {pocket.shape[0]} neurons of {pocket.shape[1]}, "
                    f"this server {self.host.shape[0]} of {self.host.shape[1]}: start it with the slide_capacity "
                    "and slide_neurons that made it, or move that folder away"
                )
            self.host, self.current = pocket, version
            self.newest = version
            self.executor.pocket_call(StagePocket(pocket.as_patch(version, 0)))
            self.on_ranks.add(version)
        graph = self.files.read_graph()
        if graph is not None:
            self.fact_graph.facts, _, self.fact_graph.next_id = graph
        for fact in [f for f in self.fact_graph.facts if f.state == "learning"]:
            self._roll_back(fact)
        log.info(
            "slide: %d facts, pocket version %d, in %s", len(self.fact_graph.facts), self.current, self.files.folder
        )

    def _roll_back(self, fact: SlideFact) -> None:
        patch = self.host.zeroed(self.newest + 1, self.current, fact.neurons)
        self.stage(patch)
        self.commit(patch.version, fact.id, "failed", "the server stopped while it was being learned")

    # ---- requests ---------------------------------------------------------------------------------------
    def version_for(self, request: EngineRequest) -> int | Refusal:
        """The version a request is computed with: the one it names, else the current one."""
        if request.pocket_version is None:
            return self.current
        if request.pocket_version not in self._held():
            return Refusal(f"pocket version {request.pocket_version} is not held", "pocket_version")
        return request.pocket_version

    def _held(self) -> set[int]:
        return {0, self.current, *self.staged}

    def wants_turn(self) -> bool:
        return self.run is not None and not self.run.done

    def turn(self, running: dict[str, int], idle: bool) -> None:
        """Between steps: a slice of training, and versions no request uses any more leave the ranks.
        `running`: each running request's pocket version."""
        if self.run is not None:
            self.run.turn(set(running), idle)
        live = self._held() | set(running.values())
        if self.on_ranks - live:
            self.executor.pocket_call(KeepVersions(sorted(live)))
            self.on_ranks &= live

    def is_capture(self, request_id: str) -> bool:
        return self.run is not None and request_id in self.run.keys

    # ---- calls ------------------------------------------------------------------------------------------
    def answer(self, call: SlideCall[Any]) -> object:
        """A living-weights call's reply (the engine checks it with `call.reply`)."""
        match call:
            case ReadGraph():
                return self.graph()
            case BeginChange(owner=owner, what=what):
                return self.begin(owner, what)
            case EndChange(owner=owner):
                self.end(owner)
            case AddFact(text=text, questions=questions):
                return self.add_fact(text, questions)
            case TrainFact(job=job):
                return self.train(job)
            case StageVersion(patch=patch):
                return self.stage(patch)
            case CommitVersion(version=version, fact_id=fact_id, state=state, reason=reason):
                return self.commit(version, fact_id, state, reason)
            case DropVersion(version=version):
                self.drop(version)
            case SetFactState(fact_id=fact_id, state=state, reason=reason):
                return self.set_state(fact_id, state, reason)
            case ZeroFact(fact_id=fact_id):
                return self.zero(fact_id)
            case ClearGraph():
                return self.clear_graph()
            case _:
                raise TypeError(f"not a slide call: {type(call).__name__}")
        return None

    def graph(self) -> SlideGraph:
        nonzero = self.host.nonzero()
        figures = PocketFigures(
            layer=self.layer,
            hidden_size=self.host.shape[1],
            neurons_per_fact=self.fact_graph.neurons_per_fact,
            capacity=self.fact_graph.capacity,
            neurons_used=len(self.fact_graph.held_neurons()),
            version=self.current,
            nonzero_neurons=int(nonzero.sum()),
        )
        busy = self.what if self._locked() else ""
        facts = copy.deepcopy(self.fact_graph.facts)
        return SlideGraph(self.files.folder.name, figures, facts, self.fact_graph.room(nonzero), busy)

    def _locked(self) -> bool:
        return bool(self.owner) and time.monotonic() < self.lease_until

    def begin(self, owner: str, what: str) -> str:
        """Take (or renew) the lock for `owner`: "" when held, else what holds it."""
        if self._locked() and self.owner != owner:
            return self.what
        if self.owner != owner:
            self._stop_run()
        self.owner, self.what, self.lease_until = owner, what, time.monotonic() + LEASE_S
        return ""

    def end(self, owner: str) -> None:
        if self.owner == owner:
            self._stop_run()
            self.owner, self.what, self.lease_until = "", "", 0.0

    def _stop_run(self) -> None:
        if self.run is not None and not self.run.done:
            self.run.stop()
        self.run = None

    def add_fact(self, text: str, questions: list[SlideQuestion]) -> SlideFact | str:
        fact = self.fact_graph.add(text, questions, self.host.nonzero())
        if isinstance(fact, SlideFact):
            self._write_graph()
        return copy.deepcopy(fact)

    def train(self, job: TrainJob) -> TrainProgress:
        """Start training `job`'s fact (the first call for it), or report its progress since the last call."""
        if self.run is None or self.run.job.fact_id != job.fact_id:
            self._stop_run()
            self.newest += 1
            self.run = TrainRun(job, self.current, self.newest, self.executor, self._add)
            log.info("slide: fact %d learning (from version %d)", job.fact_id, self.current)
        progress = self.run.take_progress()
        if progress.done:
            self.run = None
            outcome = progress.failed or f"fitted, staging as version {self.newest}"
            log.info("slide: fact %d %s", job.fact_id, outcome)
        return progress

    def stage(self, patch: PocketPatch) -> int:
        base = self.host if patch.base == self.current else self.staged[patch.base]
        self.executor.pocket_call(StagePocket(patch))
        self.staged[patch.version] = base.patched(patch)
        self.on_ranks.add(patch.version)
        self.newest = max(self.newest, patch.version)
        return patch.version

    def commit(self, version: int, fact_id: int, state: str, reason: str | None = None) -> bool:
        """Make a staged version current and set the fact's state; True once the shards and the graph file
        both hold it."""
        self.host, self.current = self.staged.pop(version), version
        self.fact_graph.set_state(fact_id, state, version, reason)
        log.info("slide: version %d current (fact %d %s)", version, fact_id, state)
        try:
            self.files.write_pocket(self.host, version)
            self._write_graph()
        except OSError:
            log.exception("slide: could not write the pocket or the graph to %s", self.files.folder)
            return False
        return True

    def drop(self, version: int) -> None:
        self.staged.pop(version, None)

    def set_state(self, fact_id: int, state: str, reason: str | None = None) -> SlideFact | None:
        fact = self.fact_graph.set_state(fact_id, state, self.current, reason)
        if fact is not None:
            self._write_graph()
        return copy.deepcopy(fact)

    def zero(self, fact_id: int) -> PocketPatch:
        """The patch zeroing a fact's neurons, as the next version from the current one."""
        fact = self.fact_graph.get(fact_id)
        if fact is None:
            raise ValueError(f"no fact {fact_id}")
        self.newest += 1
        return self.host.zeroed(self.newest, self.current, fact.neurons)

    def clear_graph(self) -> int:
        removed = self.fact_graph.clear()
        self._write_graph()
        return removed

    def _write_graph(self) -> None:
        self.files.write_graph(self.fact_graph.facts, self.current, self.fact_graph.next_id)

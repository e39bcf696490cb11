"""One fact's training in the engine's loop (docs/slide.md, Learning a fact).

First the rows: every example (question, answer), kept example and quiet sequence goes through a prompt pass as a
background request of the engine's own, its rows captured on the ranks. Then the ranks fit the fact's
neurons, a few steps per turn of the loop, so the requests being served take their steps in between.
"""

import time
from collections.abc import Callable

from deployments.messages.replies import Refusal
from deployments.messages.requests import EngineRequest, Priority, SamplingParams
from deployments.messages.slide import (
    DropCaptures,
    StartTraining,
    StopTraining,
    TakePatch,
    TrainJob,
    TrainProgress,
    TrainReport,
    TrainSteps,
)
from deployments.model_rank.executor import Executor
from deployments.model_rank.pocket_rows import capture_keys

IDLE_SLICE_S = 0.05  # an idle engine trains this long per turn; a busy one, one step per turn


class TrainRun:
    def __init__(
        self,
        job: TrainJob,
        base: int,
        version: int,
        executor: Executor,
        add: Callable[[EngineRequest], Refusal | None],
    ) -> None:
        """Start capturing the job's rows at version `base` (the fact's neurons are zero there); the fitted
        neurons will make `version`."""
        self.job, self.base, self.version, self.executor = job, base, version, executor
        self.progress = TrainProgress()
        self.started = False  # the ranks hold the rows and train
        self.step_seconds = 0.0  # the latest step's time, to size an idle turn's slice
        self.keys = self._capture(add)

    def _capture(self, add: Callable[[EngineRequest], Refusal | None]) -> list[str]:
        named = capture_keys(self.job)
        for key, tokens in named:
            refusal = add(self._capture_request(key, tokens))
            if refusal is not None:
                self._fail(f"its rows could not be computed: {refusal.message}")
                break
        return [key for key, _ in named]

    def _capture_request(self, key: str, tokens: list[int]) -> EngineRequest:
        return EngineRequest(
            request_id=key,
            prompt_token_ids=tokens,
            sampling=SamplingParams(temperature=0.0),
            max_tokens=0,
            priority=Priority.BACKGROUND,
            draft=False,
            pocket_version=self.base,
            capture=key,
        )

    @property
    def done(self) -> bool:
        return self.progress.done

    def turn(self, running: set[str], idle: bool) -> None:
        """Once the captures are done, start training; then train one slice."""
        if self.done or any(key in running for key in self.keys):
            return
        if not self.started:
            self.progress.answer_rows = self.executor.pocket_call(StartTraining(self.job, self.base, self.version))
            self.started = True
            return
        count = 1 if not idle or self.step_seconds <= 0 else max(1, int(IDLE_SLICE_S / self.step_seconds))
        started = time.monotonic()
        report = self.executor.pocket_call(TrainSteps(count))
        self.step_seconds = (time.monotonic() - started) / max(1, len(report.steps))
        self.progress.steps.extend(report.steps)
        if report.finished:
            self._finish(report)

    def _finish(self, report: TrainReport) -> None:
        if report.fitted:
            self.progress.patch = self.executor.pocket_call(TakePatch())
            self.progress.done = True
            return
        self.executor.pocket_call(StopTraining())
        if report.right < report.answer_rows:
            self._fail(
                f"not fitted in {self.job.max_steps} steps: {report.right} of {report.answer_rows} answer tokens right"
            )
        else:
            self._fail(f"not fitted in {self.job.max_steps} steps: its neurons still fire on unrelated text")

    def _fail(self, why: str) -> None:
        self.progress.failed, self.progress.done = why, True

    def stop(self) -> None:
        """Abandoned (the learn's caller ended): the ranks drop its rows and its training."""
        self.executor.pocket_call(DropCaptures(self.keys))
        self.executor.pocket_call(StopTraining())

    def take_progress(self) -> TrainProgress:
        """What happened since the last call (steps), and the result once done."""
        progress = self.progress
        self.progress = TrainProgress(answer_rows=progress.answer_rows, done=progress.done)
        self.progress.patch, self.progress.failed = progress.patch, progress.failed
        return progress

"""A rank's living-weights operations (docs/slide.md): the engine calls them by name through its executor,
on every rank alike, so every tensor-parallel rank holds the same pocket versions and trains the same way."""

from dataclasses import dataclass

import torch

from deployments.messages.slide import PocketPatch, TrainJob
from deployments.messages.step import StepPlan
from deployments.model_rank.models.base import CausalLM
from deployments.model_rank.pocket import Pocket, RowSpan
from deployments.model_rank.pocket_training import PocketTraining


@dataclass
class TrainReport:
    """What some training steps did (the same on every rank)."""

    steps: list[tuple[int, float, int]]  # (step, loss, answer rows right)
    finished: bool  # fitted, or out of steps
    fitted: bool
    answer_rows: int
    right: int  # answer rows right at the latest judgement
    silent: bool  # no quiet row fired at the latest judgement


def row_spans(plan: StepPlan) -> list[RowSpan]:
    """Each sequence's flat rows in the step, with its pocket version and capture key."""
    spans, start = [], 0
    for seq in plan.seqs:
        end = start + len(seq.new_token_ids)
        spans.append(RowSpan(start, end, seq.pocket_version, seq.capture, seq.num_computed))
        start = end
    return spans


class PocketOps:
    """The pocket on the model's last layer, and the one fact being trained."""

    def __init__(self, model: CausalLM, neurons: int, device: torch.device) -> None:
        self.model = model
        self.pocket = Pocket(model.config.hidden_size, neurons, device)
        model.model.layers[-1].pocket = self.pocket
        self.training: PocketTraining | None = None

    def call(self, op: str, *args: object) -> object:
        if op not in ("stage", "keep", "train_start", "train_run", "train_patch", "train_stop", "drop_captures"):
            raise ValueError(f"unknown pocket operation {op!r}")
        return getattr(self, op)(*args)

    def stage(self, patch: PocketPatch) -> None:
        self.pocket.stage(patch)

    def keep(self, versions: list[int]) -> None:
        self.pocket.keep_only(versions)

    def train_start(self, job: TrainJob, base: int, version: int) -> int:
        """Start fitting the job's neurons on the rows captured for it; returns the answer rows."""
        self.training = PocketTraining(job, self.pocket, self.model, base, version)
        return self.training.answer_rows

    def train_run(self, count: int) -> TrainReport:
        training = self.training
        assert training is not None, "no fact is being trained"
        reports = training.run(count)
        steps = [(r.step, r.loss, r.right) for r in reports]
        return TrainReport(
            steps, training.finished, training.fitted, training.answer_rows, training.right, training.silent
        )

    def train_patch(self) -> PocketPatch:
        assert self.training is not None and self.training.fitted, "no fitted fact to take"
        patch = self.training.patch()
        self.training = None
        return patch

    def train_stop(self) -> None:
        self.training = None

    def drop_captures(self, keys: list[str]) -> None:
        for key in keys:
            self.pocket.captures.pop(key, None)

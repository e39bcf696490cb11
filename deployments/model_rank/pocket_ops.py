"""A rank's living-weights operations (docs/slide.md): the engine makes them as typed `PocketCall`s
(messages/slide.py) through its executor, on every rank alike, so every tensor-parallel rank holds the same
pocket versions and trains the same way."""

from typing import Any

import torch

from deployments.messages.slide import (
    DropCaptures,
    KeepVersions,
    PocketCall,
    PocketPatch,
    StagePocket,
    StartTraining,
    StopTraining,
    TakePatch,
    TrainReport,
    TrainSteps,
)
from deployments.messages.step import StepPlan
from deployments.model_rank.layers.decoder import DecoderLayer
from deployments.model_rank.models.base import CausalLM
from deployments.model_rank.pocket import Pocket, RowSpan
from deployments.model_rank.pocket_training import PocketTraining


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
        last = model.model.layers[-1]
        if type(last) is not DecoderLayer:  # the pocket joins DecoderLayer's MLP sum (not a subclass's streams)
            raise ValueError(f"living weights (slide) are not served on {model.config.model_type} checkpoints")
        self.model = model
        self.pocket = Pocket(model.config.hidden_size, neurons, device)
        last.pocket = self.pocket
        self.training: PocketTraining | None = None

    def answer(self, call: PocketCall[Any]) -> object:
        """The call's reply (the engine's executor checks it with `call.reply`)."""
        match call:
            case StagePocket(patch=patch):
                self.pocket.stage(patch)
            case KeepVersions(versions=versions):
                self.pocket.keep_only(versions)
            case StartTraining(job=job, base=base, version=version):
                self.training = PocketTraining(job, self.pocket, self.model, base, version)
                return self.training.answer_rows
            case TrainSteps(count=count):
                return self._train(count)
            case TakePatch():
                return self._take_patch()
            case StopTraining():
                self.training = None
            case DropCaptures(keys=keys):
                for key in keys:
                    self.pocket.captures.pop(key, None)
            case _:
                raise TypeError(f"not a pocket operation: {type(call).__name__}")
        return None

    def _train(self, count: int) -> TrainReport:
        training = self.training
        assert training is not None, "no fact is being trained"
        reports = training.run(count)
        steps = [(r.step, r.loss, r.right) for r in reports]
        return TrainReport(
            steps, training.finished, training.fitted, training.answer_rows, training.right, training.silent
        )

    def _take_patch(self) -> PocketPatch:
        assert self.training is not None and self.training.fitted, "no fitted fact to take"
        patch = self.training.patch()
        self.training = None
        return patch

"""The rows one fact's training works on (docs/slide.md, Learning a fact), taken from the pocket's captures.

Capture keys name the job's sequences: its examples (question and answer), the kept examples (other facts'
questions and answers: still right afterwards) and the quiet sequences (where its neurons stay silent).
"""

from dataclasses import dataclass

import torch

from deployments.messages.slide import SlideExample, TrainJob
from deployments.model_rank.pocket import Pocket, PocketWeights


def capture_keys(job: TrainJob) -> list[tuple[str, list[int]]]:
    """Every sequence the job needs computed, with the key its rows are captured under."""
    named = [(f"slide-{job.fact_id}-example-{i}", e.prompt_ids + e.answer_ids) for i, e in enumerate(job.examples)]
    named += [(f"slide-{job.fact_id}-kept-{i}", e.prompt_ids + e.answer_ids) for i, e in enumerate(job.kept)]
    named += [(f"slide-{job.fact_id}-quiet-{i}", tokens) for i, tokens in enumerate(job.quiet)]
    return named


@dataclass
class AnswerRows:
    """The rows whose logits draw answers: the MLP input, the layer output before the pocket, the target."""

    x: torch.Tensor  # [R, H] float32
    h: torch.Tensor  # [R, H] float32
    targets: torch.Tensor  # [R] int64

    def __len__(self) -> int:
        return int(self.targets.numel())

    def others(self, weights: PocketWeights) -> torch.Tensor:
        """[R, H]: what the pocket's other neurons (these weights) add to these rows."""
        return torch.relu(self.x @ weights.gate.T + weights.bias) @ weights.down_t.T


@dataclass
class JobRows:
    own: AnswerRows  # the fact's own answers
    kept: AnswerRows  # other facts' answers
    quiet: torch.Tensor  # [Q, H] float32: the MLP inputs where the fact's neurons must not fire


def job_rows(job: TrainJob, pocket: Pocket) -> JobRows:
    """Take the job's captures off the pocket (each once) as rows."""
    keys = iter(capture_keys(job))
    own, prompts = _answers(job.examples, pocket, keys)
    kept, _ = _answers(job.kept, pocket, keys)
    quiet = [pocket.captures.pop(key).stacked()[0] for key, _ in keys]
    return JobRows(own, kept, torch.cat([*prompts, *quiet]))


def _answers(examples: list[SlideExample], pocket: Pocket, keys) -> tuple[AnswerRows, list[torch.Tensor]]:  # noqa: ANN001
    xs, hs, targets, prompts = [], [], [], []
    for example in examples:
        key, _ = next(keys)
        x, h = pocket.captures.pop(key).stacked()
        first, count = len(example.prompt_ids) - 1, len(example.answer_ids)  # row `first` draws the first answer token
        xs.append(x[first : first + count])
        hs.append(h[first : first + count])
        targets.extend(example.answer_ids)
        prompts.append(x[:first])  # the question's own prompt rows stay quiet
    hidden = pocket.hidden_size
    empty = torch.zeros(0, hidden, dtype=torch.float32, device=pocket.device)
    rows = AnswerRows(
        torch.cat(xs) if xs else empty,
        torch.cat(hs) if hs else empty,
        torch.tensor(targets, dtype=torch.long, device=pocket.device),
    )
    return rows, prompts

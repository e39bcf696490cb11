"""Fitting one fact's pocket neurons on a rank (docs/slide.md, Learning a fact).

The pocket sits after the last layer's MLP, so no other row's computation reads it: a row's logits are
lm_head(norm(h + pocket(x))) with `x` (the MLP's input) and `h` (the layer's output) captured once. Only the
fact's neurons are parameters. The loss is the answer rows' cross-entropy plus hinges keeping each neuron's
pre-activation above the margin on the answer rows and below minus the margin on every quiet row.

The fit is judged the way the server computes: pre-activations and the pocket's output through the same
float32 invariant matmul, the final norm and lm_head of the model itself. Fitted means every answer row's
greedy token is right and every quiet row is silent, so the checks that follow (real greedy replies) agree.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from deployments.messages.slide import PocketPatch, TrainJob
from deployments.model_rank.layers.linear import invariant_linear
from deployments.model_rank.models.base import CausalLM
from deployments.model_rank.pocket import Pocket, PocketWeights, with_pocket
from kernels import cpu_gemm

GRADIENT_TOKENS = 1024  # vocabulary rows the cross-entropy gradient is taken over: each row's likeliest, and its target
QUIET_WEIGHT = 4.0  # a quiet row firing costs this much more than an answer row not firing


def example_key(fact_id: int, index: int) -> str:
    return f"slide-{fact_id}-example-{index}"


def quiet_key(fact_id: int, index: int) -> str:
    return f"slide-{fact_id}-quiet-{index}"


@dataclass
class StepReport:
    step: int
    loss: float
    right: int  # answer rows whose greedy token is the answer's


class PocketTraining:
    """One fact's neurons, trained step by step over rows captured at `base` (its neurons zero there)."""

    def __init__(self, job: TrainJob, pocket: Pocket, model: CausalLM, base: int, version: int) -> None:
        self.job, self.pocket, self.model, self.base, self.version = job, pocket, model, base, version
        self.x_pos, self.h_pos, self.targets, self.x_quiet = self._rows(job, pocket)
        self.index = torch.tensor(job.neurons, dtype=torch.long, device=pocket.device)
        base_weights = pocket.weights(base)
        # The other neurons' part of the answer rows, held fixed while this fact's neurons move.
        others = F.relu(self.x_pos @ base_weights.gate.T + base_weights.bias) @ base_weights.down_t.T
        self.h_fixed = self.h_pos + others  # [R, H]
        self.steps_done = 0
        self.fitted = False
        self.right, self.silent = 0, False  # the latest judgement
        self.gate, self.bias, self.down = self._initial(job)
        self.optimizer = torch.optim.Adam([self.gate, self.bias, self.down], lr=job.learning_rate)

    @property
    def answer_rows(self) -> int:
        return int(self.targets.numel())

    def _rows(self, job: TrainJob, pocket: Pocket) -> tuple[torch.Tensor, ...]:
        x_pos, h_pos, targets, quiet = [], [], [], []
        for index, example in enumerate(job.examples):
            x, h = pocket.captures.pop(example_key(job.fact_id, index)).stacked()
            first = len(example.prompt_ids) - 1  # the row whose logits draw the answer's first token
            x_pos.append(x[first : first + len(example.answer_ids)])
            h_pos.append(h[first : first + len(example.answer_ids)])
            targets.extend(example.answer_ids)
            quiet.append(x[:first])  # the question's own prompt rows stay quiet too
        for index in range(len(job.quiet)):
            quiet.append(pocket.captures.pop(quiet_key(job.fact_id, index)).stacked()[0])
        as_long = torch.tensor(targets, dtype=torch.long, device=pocket.device)
        return torch.cat(x_pos), torch.cat(h_pos), as_long, torch.cat(quiet)

    def _initial(self, job: TrainJob) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Neuron j answers the rows r with r % n == j: its key points from the quiet rows' mean to its rows'
        mean, biased so its rows start at the margin; values zero (the model starts unchanged)."""
        n, rows = len(job.neurons), self.x_pos.shape[0]
        r, j = torch.arange(rows)[:, None], torch.arange(n)[None, :]
        self.assigned = (r % n == j) | (j % rows == r)  # [R, n]: each row has a neuron, each neuron a row
        quiet_mean = self.x_quiet.mean(dim=0) if self.x_quiet.shape[0] else torch.zeros_like(self.x_pos[0])
        keys, biases = [], []
        for j in range(n):
            mine = self.x_pos[self.assigned[:, j]]
            key = mine.mean(dim=0) - quiet_mean
            key = key / key.norm().clamp_min(1e-6)
            keys.append(key)
            biases.append(job.margin - (mine @ key).min())
        gate = torch.stack(keys)
        bias = torch.stack(biases)
        down = torch.zeros(n, self.x_pos.shape[1], dtype=torch.float32, device=self.pocket.device)
        return gate.requires_grad_(), bias.detach().requires_grad_(), down.requires_grad_()

    # ---- one step ----------------------------------------------------------------------------------------
    def step(self) -> StepReport:
        """Judge the current weights as the server computes; stop there if they fit, else one Adam step."""
        right, silent, loss = self._judge()
        self.right, self.silent = right, silent
        self.fitted = right == self.answer_rows and silent
        report = StepReport(self.steps_done, loss, right)
        if not self.fitted:
            self._descend()
            self.steps_done += 1
        return report

    @torch.no_grad()
    def _judge(self) -> tuple[int, bool, float]:
        weights = self.candidate()
        logits = self.model.compute_logits(self.model.model.norm(with_pocket(self.x_pos, self.h_served, weights)))
        right = int((logits.argmax(dim=-1) == self.targets).sum())
        quiet = invariant_linear(self.x_quiet, self.gate.detach(), self.bias.detach())  # [Q, n]
        return right, bool((quiet <= -self.job.margin).all()), float(F.cross_entropy(logits, self.targets))

    @property
    def h_served(self) -> torch.Tensor:
        """The answer rows' layer output before the pocket, in the model's dtype (as a step holds it)."""
        return self.h_pos.to(self.model.config.dtype)

    def candidate(self) -> PocketWeights:
        """The whole pocket this fact's current neurons would make (the base with them in place)."""
        base = self.pocket.weights(self.base)
        gate, bias, down_t = base.gate.clone(), base.bias.clone(), base.down_t.clone()
        gate[self.index], bias[self.index] = self.gate.detach(), self.bias.detach()
        down_t[:, self.index] = self.down.detach().T
        return PocketWeights(gate, bias, down_t.contiguous(), live=True)

    def _descend(self) -> None:
        self.optimizer.zero_grad()
        with torch.enable_grad():
            pre_pos = self.x_pos @ self.gate.T + self.bias  # [R, n]
            pre_quiet = self.x_quiet @ self.gate.T + self.bias  # [Q, n]
            hidden = self.h_fixed + F.relu(pre_pos) @ self.down  # [R, H]
            normed = self._norm(hidden)
            surrogate = (normed * self._logit_gradient(normed.detach())).sum()
            margin = self.job.margin
            hinge_on = F.relu(margin - pre_pos)[self.assigned].mean()
            hinge_off = F.relu(pre_pos + margin)[~self.assigned].mean() if (~self.assigned).any() else 0.0
            hinge_quiet = F.relu(pre_quiet + margin).mean() * QUIET_WEIGHT
            (surrogate + hinge_on + hinge_off + hinge_quiet).backward()
        self.optimizer.step()

    def _norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm, differentiable, in float32."""
        norm = self.model.model.norm
        scaled = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.eps)
        return scaled * norm.weight.float()

    def _logit_gradient(self, normed: torch.Tensor) -> torch.Tensor:
        """d(mean cross-entropy)/d(normed) [R, H], over each row's likeliest tokens and its target (the rest of
        the vocabulary holds too little probability to move the rows)."""
        logits = self.model.compute_logits(normed.to(self.model.config.dtype))  # [R, V]
        probs = logits.softmax(dim=-1)
        top = probs.topk(min(GRADIENT_TOKENS, probs.shape[1]), dim=-1).indices  # [R, k]
        ids = torch.unique(torch.cat([top.flatten(), self.targets]))
        rows = _head_rows(self.model, ids)  # [|ids|, H] float32
        grad = probs[:, ids] - (self.targets[:, None] == ids[None, :]).float()  # [R, |ids|]
        return grad @ rows / self.answer_rows

    # ---- the result -------------------------------------------------------------------------------------
    def patch(self) -> PocketPatch:
        numpy = lambda t: t.detach().cpu().numpy().astype(np.float32)  # noqa: E731
        return PocketPatch(
            version=self.version,
            base=self.base,
            neurons=list(self.job.neurons),
            gate=numpy(self.gate),
            bias=numpy(self.bias),
            down=numpy(self.down),
        )

    def run(self, count: int) -> list[StepReport]:
        """Up to `count` steps, ending early once fitted or out of steps (a count, not a time: every
        tensor-parallel rank must take the same steps)."""
        reports: list[StepReport] = []
        while not self.finished and len(reports) < count:
            reports.append(self.step())
        return reports

    @property
    def finished(self) -> bool:
        return self.fitted or self.steps_done >= self.job.max_steps


def _head_rows(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    weight = model.lm_head.weight
    if cpu_gemm.is_packed(weight):
        return cpu_gemm.rows(weight, ids).float()
    return weight[ids].float()

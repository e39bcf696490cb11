"""Fitting one fact's pocket neurons on a rank (docs/slide.md, Learning a fact).

The pocket sits after the last layer's MLP, so no other row's computation reads it: a row's logits are
lm_head(norm(h + pocket(x))) with `x` (the MLP's input) and `h` (the layer's output) captured once. Only the
fact's neurons are parameters. Each starts as a narrow cap around its answer rows (the MLP's input is
RMS-normed, so rows have nearly one length and `key . x > threshold` holds only near the key); then the
values learn the answers (cross-entropy), with hinges keeping each neuron on at its rows and off elsewhere.

A fit is judged the way the server computes (pocket.py's float32 invariant matmul, the model's own final norm
and lm_head): every answer row's greedy token right, with the other facts' neurons and without them (they may
be deleted); every kept row (other facts' answers) still right; every quiet row silent.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from deployments.messages.slide import PocketPatch, TrainJob
from deployments.model_rank.layers.linear import invariant_linear
from deployments.model_rank.layers.quantized import qtype_of
from deployments.model_rank.models.base import CausalLM
from deployments.model_rank.pocket import Pocket, PocketWeights, with_pocket
from deployments.model_rank.pocket_rows import AnswerRows, job_rows
from kernels import cpu_gemm, quant_gemm

GRADIENT_TOKENS = 1024  # vocabulary rows the cross-entropy gradient is taken over: each row's likeliest, and its target
QUIET_WEIGHT = 4.0  # a quiet row firing costs this much more than an answer row not firing
CAP = 0.02  # a neuron's threshold at most this fraction of its rows' length below them
SEPARATE_STEPS = 400  # steps to find a key that separates a neuron's rows from the rest, where the mean does not
KEY_RATE = 0.1  # such keys then move this much slower than values: a cap that drifts fires on unseen text


@dataclass
class StepReport:
    step: int
    loss: float
    right: int  # answer rows whose greedy token is the answer's (the worse case)


class PocketTraining:
    """One fact's neurons, trained step by step over rows captured at `base` (its neurons zero there)."""

    def __init__(self, job: TrainJob, pocket: Pocket, model: CausalLM, base: int, version: int) -> None:
        self.job, self.pocket, self.model, self.base, self.version = job, pocket, model, base, version
        rows = job_rows(job, pocket)
        self.own, self.kept, self.quiet = rows.own, rows.kept, rows.quiet
        self.index = torch.tensor(job.neurons, dtype=torch.long, device=pocket.device)
        base_weights = pocket.weights(base)
        others = self.own.others(base_weights)
        # Other facts' neurons firing on these rows may be deleted later: the fit must hold without them too.
        self.cases = [self.own.h + others] + ([self.own.h] if bool(others.any()) else [])  # each [R, H]
        self.kept_fixed = self.kept.h + self.kept.others(base_weights)
        self.steps_done, self.fitted = 0, False
        self.right, self.silent = 0, False  # the latest judgement
        self.gate, self.bias, self.separated = self._caps(job)
        self.down = torch.zeros(len(job.neurons), pocket.hidden_size, device=pocket.device, requires_grad=True)
        keys = {"params": [self.gate, self.bias], "lr": job.learning_rate * KEY_RATE}
        self.optimizer = torch.optim.Adam([keys, {"params": [self.down]}], lr=job.learning_rate)

    @property
    def answer_rows(self) -> int:
        return len(self.own)

    # ---- the start: one cap per neuron ------------------------------------------------------------------
    def _caps(self, job: TrainJob) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Neuron j answers the rows r with r % n == j (and row j % R): each row has a neuron."""
        n, rows = len(job.neurons), len(self.own)
        r, j = torch.arange(rows)[:, None], torch.arange(n)[None, :]
        self.assigned = (r % n == j) | (j % rows == r)  # [R, n]
        caps = [self._cap(self.own.x[self.assigned[:, k]], self.own.x[~self.assigned[:, k]]) for k in range(n)]
        gate, bias, separated = (torch.stack(parts) for parts in zip(*caps))
        return gate.requires_grad_(), bias.requires_grad_(), separated

    def _cap(self, mine: torch.Tensor, unowned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate, bias, separated): `mine` at +margin or more, every other row at -margin or less."""
        others = torch.cat([self.quiet, unowned])
        key = mine.mean(dim=0)
        key = key / key.norm().clamp_min(1e-6)
        gap = (mine @ key).min() - (others @ key).max() if others.shape[0] else torch.tensor(1.0)
        if gap <= 0:
            key = _separating_key(mine, others, key)
            gap = (mine @ key).min() - (others @ key).max() if others.shape[0] else torch.tensor(1.0)
        low = (mine @ key).min()
        depth = torch.clamp(gap / 3, max=CAP * low.abs()).clamp_min(1e-4)  # the others at -2 margins or less
        scale = self.job.margin / depth
        return key * scale, -(low - depth) * scale, gap > 0

    # ---- one step ----------------------------------------------------------------------------------------
    def step(self) -> StepReport:
        """Judge the current weights as the server computes; stop there if they fit, else one Adam step."""
        right, kept, silent, loss = self._judge()
        self.right, self.silent = right, silent and kept
        self.fitted = right == self.answer_rows and self.silent
        report = StepReport(self.steps_done, loss, right)
        if not self.fitted:
            self._descend()
            self.steps_done += 1
        return report

    @torch.no_grad()
    def _judge(self) -> tuple[int, bool, bool, float]:
        """(own answer rows right in the worse case, kept rows all right, quiet rows all silent, the loss)."""
        right, loss = self.answer_rows, 0.0
        full, alone = self.candidates()
        for weights in (full, alone)[: len(self.cases)]:
            logits = self._served(self.own, weights)
            right = min(right, int((logits.argmax(dim=-1) == self.own.targets).sum()))
            loss = max(loss, float(F.cross_entropy(logits, self.own.targets)))
        kept = len(self.kept) == 0 or bool((self._served(self.kept, full).argmax(dim=-1) == self.kept.targets).all())
        quiet = invariant_linear(self.quiet, self.gate.detach(), self.bias.detach())  # [Q, n]
        return right, kept, bool((quiet <= -self.job.margin).all()), loss

    def _served(self, rows: AnswerRows, weights: PocketWeights) -> torch.Tensor:
        hidden = with_pocket(rows.x, rows.h.to(self.model.config.dtype), weights)
        return self.model.compute_logits(self.model.model.norm(hidden))  # [R, V]

    def candidates(self) -> tuple[PocketWeights, PocketWeights]:
        """The whole pocket this fact's current neurons would make (the base with them in place), and the
        pocket holding only them (every other fact deleted)."""
        base = self.pocket.weights(self.base)
        made = []
        for gate, bias, down_t in (
            (base.gate, base.bias, base.down_t),
            (0 * base.gate, 0 * base.bias, 0 * base.down_t),
        ):
            gate, bias, down_t = gate.clone(), bias.clone(), down_t.clone()
            gate[self.index], bias[self.index] = self.gate.detach(), self.bias.detach()
            down_t[:, self.index] = self.down.detach().T
            made.append(PocketWeights(gate, bias, down_t.contiguous(), live=True))
        return made[0], made[1]

    def _descend(self) -> None:
        self.optimizer.zero_grad()
        with torch.enable_grad():
            pre_own = self.own.x @ self.gate.T + self.bias  # [R, n]
            pre_kept = self.kept.x @ self.gate.T + self.bias  # [K, n]
            pre_quiet = self.quiet @ self.gate.T + self.bias  # [Q, n]
            added = F.relu(pre_own) @ self.down  # [R, H]
            hidden = torch.cat([*(case + added for case in self.cases), self.kept_fixed + F.relu(pre_kept) @ self.down])
            targets = torch.cat([*(self.own.targets for _ in self.cases), self.kept.targets])
            normed = self._norm(hidden)
            surrogate = (normed * self._logit_gradient(normed.detach(), targets)).sum()
            margin = self.job.margin
            hinge_on = F.relu(margin - pre_own)[self.assigned].mean()
            hinge_off = F.relu(pre_own + margin)[~self.assigned].mean() if (~self.assigned).any() else 0.0
            hinge_quiet = F.relu(pre_quiet + margin).mean() * QUIET_WEIGHT
            (surrogate + hinge_on + hinge_off + hinge_quiet).backward()
        for tensor in (self.gate, self.bias):
            assert tensor.grad is not None
            tensor.grad[self.separated] = 0  # a separating cap stays where it is
        self.optimizer.step()

    def _norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm, differentiable, in float32."""
        norm = self.model.model.norm
        scaled = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.eps)
        return scaled * norm.weight.float()

    def _logit_gradient(self, normed: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """d(mean cross-entropy)/d(normed) [N, H], over each row's likeliest tokens and its target (the rest of
        the vocabulary holds too little probability to move the rows)."""
        logits = self.model.compute_logits(normed.to(self.model.config.dtype))  # [N, V]
        probs = logits.softmax(dim=-1)
        top = probs.topk(min(GRADIENT_TOKENS, probs.shape[1]), dim=-1).indices  # [N, k]
        ids = torch.unique(torch.cat([top.flatten(), targets]))
        grad = probs[:, ids] - (targets[:, None] == ids[None, :]).float()  # [N, |ids|]
        return grad @ _head_rows(self.model, ids) / len(targets)

    # ---- the result -------------------------------------------------------------------------------------
    def patch(self) -> PocketPatch:
        numpy = lambda t: t.detach().cpu().numpy().astype(np.float32)  # noqa: E731
        return PocketPatch(
            self.version, self.base, list(self.job.neurons), numpy(self.gate), numpy(self.bias), numpy(self.down)
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


def _separating_key(mine: torch.Tensor, others: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """A unit key along which every row of `mine` lies above every row of `others`, found by a hinge descent
    from `start` (the rows' mean direction); the best found if none separates."""
    key = start.clone().requires_grad_()
    optimizer = torch.optim.Adam([key], lr=0.01)
    for _ in range(SEPARATE_STEPS):
        with torch.enable_grad():
            unit = key / key.norm()
            gap = (mine @ unit).min() - (others @ unit).max()
            if gap > 0:
                break
            optimizer.zero_grad()
            (F.relu(-(mine @ unit)[:, None] + (others @ unit)[None, :] + 1e-3).mean()).backward()
        optimizer.step()
    return (key / key.norm()).detach()


def _head_rows(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    weight = model.lm_head.weight
    qtype = qtype_of(weight)
    if qtype is not None:  # a GGUF head kept as blocks
        return quant_gemm.rows(weight, qtype, ids)
    if cpu_gemm.is_packed(weight):
        return cpu_gemm.rows(weight, ids).float()
    return weight[ids].float()

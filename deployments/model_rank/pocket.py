"""Living weights on a rank (docs/slide.md): the pocket beside the last decoder layer's MLP.

out = mlp(x) + relu(x @ gate.T + bias) @ down, in float32 through the batch-invariant matmul. Every version
the engine still uses is held here; before each step the runner says which rows use which version, and which
sequences' rows to capture for training (the MLP's input, and the layer's output before the pocket).
"""

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from deployments.messages.slide import PocketPatch
from deployments.model_rank.layers.linear import invariant_linear


@dataclass
class PocketWeights:
    """One version of the whole pocket: float32 on the rank's device."""

    gate: torch.Tensor  # [P, H]
    bias: torch.Tensor  # [P]
    down_t: torch.Tensor  # [H, P]: `down` transposed, as invariant_linear takes its weight
    live: bool  # some neuron is not all zero (an all-zero pocket is skipped: it adds exactly nothing)


@dataclass
class RowSpan:
    """One sequence's rows in a step: [start, end) of the flat rows, its version, its capture key."""

    start: int
    end: int
    version: int
    capture: str | None = None
    first_position: int = 0  # the sequence position of its first row (captures arrive chunk by chunk)


@dataclass
class Capture:
    """A sequence's captured rows, keyed by position: the MLP input and the layer output before the pocket
    (both [H] float32)."""

    x: dict[int, torch.Tensor] = field(default_factory=dict)
    h: dict[int, torch.Tensor] = field(default_factory=dict)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        order = sorted(self.x)
        if order != list(range(len(order))):
            raise ValueError("a capture is missing rows")
        return torch.stack([self.x[p] for p in order]), torch.stack([self.h[p] for p in order])


class Pocket(nn.Module):
    """The neurons of every held version; `__call__(x, out)` adds each row's version's output to `out`."""

    def __init__(self, hidden_size: int, num_neurons: int, device: torch.device) -> None:
        super().__init__()
        self.hidden_size, self.num_neurons, self.device = hidden_size, num_neurons, device
        self.versions: dict[int, PocketWeights] = {0: self._zeros()}
        self.spans: list[RowSpan] = []  # set by the runner before each forward pass
        self.captures: dict[str, Capture] = {}

    def _zeros(self) -> PocketWeights:
        p, h = self.num_neurons, self.hidden_size
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float32, device=self.device)  # noqa: E731
        return PocketWeights(zeros(p, h), zeros(p), zeros(h, p), live=False)

    # ---- versions --------------------------------------------------------------------------------------
    def stage(self, patch: PocketPatch) -> None:
        """Make `patch.version`: its base with the patch's neurons replaced."""
        base = self.versions[patch.base]
        gate, bias, down_t = base.gate.clone(), base.bias.clone(), base.down_t.clone()
        index = torch.tensor(patch.neurons, dtype=torch.long, device=self.device)
        as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(self.device)  # noqa: E731
        gate[index] = as_tensor(patch.gate)
        bias[index] = as_tensor(patch.bias)
        down_t[:, index] = as_tensor(patch.down).T
        live = bool(gate.any() or bias.any() or down_t.any())
        self.versions[patch.version] = PocketWeights(gate, bias, down_t.contiguous(), live)

    def keep_only(self, versions: list[int]) -> None:
        """Drop every version but these (the engine's versions still in use)."""
        for version in [v for v in self.versions if v not in versions and v != 0]:
            del self.versions[version]

    def weights(self, version: int) -> PocketWeights:
        return self.versions[version]

    # ---- the forward pass ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` [T, H] with each row's pocket output added; rows no neuron fires on are left bit for bit."""
        for span in self.spans:
            if span.capture is not None:  # before the pocket: training adds the candidate's own
                self._capture(x, out, span, span.capture)
            weights = self.versions[span.version]
            if weights.live:
                rows = slice(span.start, span.end)
                out[rows] = with_pocket(x[rows].float(), out[rows], weights)
        return out

    def _capture(self, x: torch.Tensor, out: torch.Tensor, span: RowSpan, key: str) -> None:
        capture = self.captures.setdefault(key, Capture())
        for offset in range(span.end - span.start):
            position = span.first_position + offset
            capture.x[position] = x[span.start + offset].float().clone()
            capture.h[position] = out[span.start + offset].float().clone()


def with_pocket(x: torch.Tensor, out: torch.Tensor, weights: PocketWeights) -> torch.Tensor:
    """`out` [n, H] with the pocket's output added where a neuron fires (`x`: [n, H] float32); the other rows
    are returned as they were, bit for bit. Each row's result is independent of the rows beside it."""
    act = F.relu(invariant_linear(x, weights.gate, weights.bias))  # [n, P]
    fired = (act > 0).any(dim=1).nonzero().flatten()
    if fired.numel() == 0:
        return out
    delta = invariant_linear(act[fired], weights.down_t)  # [f, H]
    return out.index_copy(0, fired, (out.index_select(0, fired).float() + delta).to(out.dtype))

"""The engine's copy of the current pocket (docs/slide.md): what the files hold and deletions start from."""

from dataclasses import dataclass

import numpy as np

from deployments.messages.slide import PocketPatch


@dataclass
class HostPocket:
    """The whole pocket in float32: gate [P, H], bias [P], down [P, H] (neuron i's rows)."""

    gate: np.ndarray
    bias: np.ndarray
    down: np.ndarray

    @classmethod
    def zeros(cls, neurons: int, hidden: int) -> "HostPocket":
        return cls(
            np.zeros((neurons, hidden), np.float32),
            np.zeros(neurons, np.float32),
            np.zeros((neurons, hidden), np.float32),
        )

    @property
    def shape(self) -> tuple[int, int]:
        neurons, hidden = self.gate.shape
        return neurons, hidden

    def patched(self, patch: PocketPatch) -> "HostPocket":
        gate, bias, down = self.gate.copy(), self.bias.copy(), self.down.copy()
        gate[patch.neurons], bias[patch.neurons], down[patch.neurons] = patch.gate, patch.bias, patch.down
        return HostPocket(gate, bias, down)

    def nonzero(self) -> np.ndarray:
        """[P] bool: the neurons with any weight not zero."""
        return (self.gate != 0).any(axis=1) | (self.bias != 0) | (self.down != 0).any(axis=1)

    def as_patch(self, version: int, base: int, neurons: list[int] | None = None) -> PocketPatch:
        """These neurons (all by default) as a patch from `base`."""
        chosen = list(range(self.shape[0])) if neurons is None else neurons
        return PocketPatch(version, base, chosen, self.gate[chosen], self.bias[chosen], self.down[chosen])

    def zeroed(self, version: int, base: int, neurons: list[int]) -> PocketPatch:
        """The patch setting these neurons to zero."""
        hidden = self.shape[1]
        n = len(neurons)
        return PocketPatch(
            version, base, list(neurons), np.zeros((n, hidden), np.float32), np.zeros(n, np.float32),
            np.zeros((n, hidden), np.float32),
        )  # fmt: skip

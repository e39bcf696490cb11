"""The sampled rows' settings on their device, as the keyed draw reads them (keyed_draw.py)."""

from dataclasses import dataclass

import torch


@dataclass
class DrawSettings:
    """The sampled rows' settings on the device: `table` [R, 5] float64, one row per draw of (temperature
    above 0, top_p in (0, 1], min_p in [0, 1], the key's uniform in [0, 1), top_k: 0 off)."""

    table: torch.Tensor
    top_k_max: int  # the largest top-k of the rows, 0 when some row does not cut at top-k

    @property
    def temperature(self) -> torch.Tensor:
        return self.table[:, 0:1]

    @property
    def top_p(self) -> torch.Tensor:
        return self.table[:, 1:2]

    @property
    def min_p(self) -> torch.Tensor:
        return self.table[:, 2:3]

    @property
    def uniform(self) -> torch.Tensor:
        return self.table[:, 3:4]

    @property
    def top_k(self) -> torch.Tensor:
        return self.table[:, 4:5].to(torch.int64)

    def rows(self, row: int) -> "DrawSettings":
        """One row's settings."""
        top_k = int(self.table[row, 4])
        return DrawSettings(self.table[row : row + 1], top_k if self.top_k_max else 0)

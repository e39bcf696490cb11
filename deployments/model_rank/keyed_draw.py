"""The keyed draw of many rows at once, on the device their logits are on (docs/engine.md, Keyed sampling).

Each row draws from its own head of the rank order (rank_head.py) with its own settings; the cuts follow
SGLang's order: temperature, top-k, top-p on the temperature distribution, then min-p relative to the
likeliest token. Every figure the cuts and the draw compare is an exact integer sum of masses
(keyed_mass.py), so the token does not depend on the head's width, the reduction order or the device.
"""

from dataclasses import dataclass

import torch

from deployments.model_rank import rank_head
from deployments.model_rank.keyed_mass import MASS_CONSTANTS, fraction_bits, masses
from kernels import cpu_sampling

TOP_K_HEAD = 1024  # rows that all cut at top-k this small read their top-k set alone


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


def draw_rows(x: torch.Tensor, settings: DrawSettings) -> torch.Tensor:
    """Each row's token [R] (int64, on x's device) from its logits `x` [R, V] (float32, NaN as -inf,
    a grammar's disallowed ids -inf); no host sync on a GPU. On CPU one native call draws every row by
    the same rule (kernels/cpu/keyed_draw.c)."""
    bits = fraction_bits(x.shape[-1])
    if cpu_sampling.supports(x):
        return cpu_sampling.keyed_draw(x, settings.table, bits, MASS_CONSTANTS)
    ids, values = _head(x, settings)
    return draw_from_head(ids, values, settings, bits)


def _head(x: torch.Tensor, settings: DrawSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top-k set (when every row cuts at a small top-k), else on a GPU the whole sorted row,
    on a CPU the tokens above the mass floor (rank_head.py)."""
    x = torch.where(x.isnan(), float("-inf"), x)
    if 0 < settings.top_k_max <= min(TOP_K_HEAD, x.shape[-1] - 1):
        return rank_head.top_of_rank(x, settings.top_k_max)
    if x.device.type != "cpu":
        return rank_head.sorted_rows(x)
    floor = rank_head.mass_floor(x.amax(dim=-1, keepdim=True), settings.temperature)
    return rank_head.above_floor(x, floor, (x >= floor).sum(dim=-1).tolist())


def draw_from_head(ids: torch.Tensor, values: torch.Tensor, settings: DrawSettings, bits: int) -> torch.Tensor:
    """The keyed token of each row [R] from its head: `ids` and `values` [R, N] in rank order.

    Top-k keeps the first k; top-p keeps a token while the mass before it is below top_p times the top-k
    set's; min-p keeps tokens of mass at least min_p times the likeliest's (2^K); then the token is the first
    kept one whose running kept mass exceeds floor(u * kept mass). A row with nothing of mass (no finite
    logit) takes its first token."""
    mass = masses(values, values[:, :1], settings.temperature, bits)
    position = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    mass = torch.where((settings.top_k <= 0) | (position < settings.top_k), mass, 0)
    running = mass.cumsum(dim=-1)
    before = (running - mass).to(torch.float64)
    total = running[:, -1:].to(torch.float64)
    keep = (mass > 0) & (before < settings.top_p * total) & (mass.to(torch.float64) >= settings.min_p * 2.0**bits)
    kept = torch.where(keep, mass, 0).cumsum(dim=-1)
    kept_mass = kept[:, -1:]
    target = torch.minimum(torch.floor(settings.uniform * kept_mass.to(torch.float64)).to(torch.int64), kept_mass - 1)
    index = (kept <= target).sum(dim=-1, keepdim=True)  # the first kept token past the target
    return ids.gather(1, index).squeeze(1)

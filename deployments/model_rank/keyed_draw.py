"""The keyed draw of many rows at once, on the device their logits are on (docs/engine.md, Keyed sampling).

Each row draws from its own head of the rank order (rank_head.py) with its own settings; the cuts follow
SGLang's order: temperature, top-k, top-p on the temperature distribution, then min-p relative to the
likeliest token. Every figure the cuts and the draw compare is an exact integer sum of masses
(keyed_mass.py), so the token does not depend on the head's width, the reduction order or the device.
A CPU without the native kernels draws a row at a time, reading the rank order's head 64, then 1,024, then
every weighing token deep, only as far as the cuts and the draw reach (`draw_row`): a trained model's rows
stop in the first head instead of sorting the vocabulary.
"""

import math
from dataclasses import dataclass

import torch

from deployments.model_rank import rank_head
from deployments.model_rank.keyed_mass import MASS_CONSTANTS, fraction_bits, masses
from kernels import cpu_sampling

TOP_K_HEAD = 1024  # rows that all cut at top-k this small read their top-k set alone
HEADS = (64, 1024)  # the heads a CPU without the native kernels reads before the whole weighing part


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


def draw_rows(x: torch.Tensor, settings: DrawSettings) -> torch.Tensor:
    """Each row's token [R] (int64, on x's device) from its logits `x` [R, V] (float32, NaN as -inf,
    a grammar's disallowed ids -inf); no host sync on a GPU. On CPU one native call draws every row by
    the same rule (kernels/cpu/keyed_draw.c)."""
    bits = fraction_bits(x.shape[-1])
    if cpu_sampling.supports(x):
        return cpu_sampling.keyed_draw(x, settings.table, bits, MASS_CONSTANTS)
    if x.device.type == "cpu":  # a row at a time: its float64 buffers are reused, its head read as deep as needed
        return torch.cat([_draw_on_cpu(x[row : row + 1], settings.rows(row), bits) for row in range(x.shape[0])])
    x = torch.where(x.isnan(), float("-inf"), x)
    if 0 < settings.top_k_max <= min(TOP_K_HEAD, x.shape[-1] - 1):
        return draw_from_head(*rank_head.top_of_rank(x, settings.top_k_max), settings, bits)
    return draw_from_head(*rank_head.sorted_rows(x), settings, bits)


def _draw_on_cpu(x: torch.Tensor, settings: DrawSettings, bits: int) -> torch.Tensor:
    if bool(x.isnan().any()):
        x = torch.where(x.isnan(), float("-inf"), x)
    if 0 < settings.top_k_max < x.shape[-1]:
        return draw_from_head(*rank_head.top_of_rank(x, settings.top_k_max), settings, bits)
    return draw_row(x, settings, bits)


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


def draw_row(x: torch.Tensor, settings: DrawSettings, bits: int) -> torch.Tensor:
    """The token [1] of one row `x` [1, V] (float32, no NaN) that cuts at no top-k."""
    top = x.amax(dim=-1, keepdim=True)
    weighs = (x >= rank_head.mass_floor(top, settings.temperature))[0]
    every = masses(x[:, weighs], top, settings.temperature, bits)[0]  # in id order
    total = int(every.sum())
    if total == 0:  # nothing weighs: the first token
        return rank_head.top_of_rank(x, 1)[0][0]
    _, top_p, min_p, u, _ = settings.table[0].tolist()
    least, p_total = min_p * 2.0**bits, top_p * total  # the float products draw_from_head compares with
    kept_mass = None  # with no top-p cut the kept mass needs no order
    if not p_total < total:
        kept_mass = int(every[(every > 0) & (every.to(torch.float64) >= least)].sum())
    needed = p_total if kept_mass is None else min(math.floor(u * kept_mass), kept_mass - 1) + 1
    for width in [w for w in HEADS if w < every.numel()]:
        ids, values = rank_head.top_of_rank(x, width)
        mass = masses(values, values[:, :1], settings.temperature, bits)[0]
        index = _within(mass, p_total, least, u, kept_mass)
        if index is not None:
            return ids[0, index : index + 1]
        if int(mass.sum()) + (HEADS[-1] - width) * int(mass[-1]) < needed:
            break  # a flat row: no longer head of tokens weighing at most its last can reach far enough
    order = torch.sort(x[0, weighs], descending=True, stable=True).indices  # every weighing token, ranked
    index = _within(every[order], p_total, least, u, kept_mass)
    assert index is not None, "a head holding every weighing token holds the draw"
    return weighs.nonzero()[order[index], 0:1]


def _within(mass: torch.Tensor, p_total: float, least: float, u: float, kept_mass: int | None) -> int | None:
    """The drawn position if this head (masses [w] in rank order) holds it, else None. `kept_mass`: the
    kept mass when top-p cuts nothing; else it is read here, once the top-p boundary lies in the head."""
    running = mass.cumsum(dim=0)
    keep = (mass > 0) & ((running - mass).to(torch.float64) < p_total) & (mass.to(torch.float64) >= least)
    kept = torch.where(keep, mass, 0).cumsum(dim=0)
    if kept_mass is None:
        if not float(running[-1]) >= p_total:
            return None
        kept_mass = int(kept[-1])
    target = min(math.floor(u * kept_mass), kept_mass - 1)
    if not int(kept[-1]) > target:
        return None
    return int((kept <= target).sum())

"""One row's keyed draw on a CPU without the native kernels: the rank order's head read 64, then 1,024,
then every weighing token deep, only as far as the cuts and the draw reach (docs/engine.md, Keyed sampling).

Every token above the mass floor weighs into the row's total, so all their masses are computed, unsorted;
the head, in rank order, gives the running masses. A cut or a draw found inside a head is where it is in
any longer one (the same masses, summed exactly), so the token is keyed_draw.draw_from_head's; a trained
model's rows stop in the first head instead of sorting the vocabulary.
"""

import math

import torch

from deployments.model_rank import rank_head
from deployments.model_rank.draw_inputs import DrawSettings
from deployments.model_rank.keyed_mass import masses

HEADS = (64, 1024)


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

"""The keyed draw of many rows at once, on the device their logits are on (docs/engine.md, Keyed sampling).

Each row draws from its own head of the rank order (rank_head.py) with its own settings; the cuts follow
SGLang's order: temperature, top-k, top-p on the temperature distribution, then min-p relative to the
likeliest token. Every figure the cuts and the draw compare is an exact integer sum of masses
(keyed_mass.py), so the token does not depend on the head's width, the reduction order or the device.
"""

import torch

from deployments.model_rank import rank_head
from deployments.model_rank.draw_inputs import DrawSettings
from deployments.model_rank.head_walk import draw_row
from deployments.model_rank.keyed_mass import MASS_CONSTANTS, fraction_bits, masses
from kernels import cpu_sampling

TOP_K_HEAD = 1024  # rows that all cut at top-k this small read their top-k set alone


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

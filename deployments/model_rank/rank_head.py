"""The head of a row's rank order (logit descending, ties by lower id): the tokens a keyed draw can reach.

Any head the draw is given holds, for each row, a prefix of its rank order that covers every token of
non-zero mass in its top-k set, or is read only as far as the cuts and the draw reach (keyed_draw.draw_row);
which one is a matter of speed, not of the token (keyed_draw.py): tokens past the prefix weigh nothing.
Two ways to take it, both exact at ties:

- `top_of_rank`: the first n of each row, with no host sync (the top-k set, or a logprob row's best).
- `sorted_rows`: every token, one sort (on a GPU, where a sort of the vocabulary is cheap).

`mass_floor` bounds from below the logits that can weigh anything.
"""

import torch

from deployments.model_rank.keyed_mass import FLOOR

_FAR = 2.0**50  # |x_max / T| below this keeps `mass_floor`'s margin safe (docs/engine.md, Keyed sampling)


def top_of_rank(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, logits) [R, n] of the first n tokens of each row of `x` [R, V] (no NaN) in rank order.

    topk finds the n-th value exactly but may pick any of its ties; the ties it takes are replaced by the
    lowest ids holding that value (the j-th tie is where the running count of ties reaches j)."""
    values, ids = torch.topk(x, n, dim=-1)
    kth = values[:, -1:]
    if x.device.type == "cpu" and bool(((x >= kth).sum(dim=-1) == n).all()):
        return rank_order(ids, values)  # no tie reaches past the n-th place (a CPU may read that back)
    above = (x > kth).sum(dim=-1, keepdim=True)  # < n: every one of them is among topk's first slots
    tie_count = (x == kth).cumsum(dim=-1)
    slots = torch.arange(n, device=x.device).unsqueeze(0)
    wanted = (slots - above + 1).clamp(min=1)
    tie_ids = torch.searchsorted(tie_count, wanted)
    ids = torch.where(slots < above, ids, tie_ids)
    return rank_order(ids, torch.where(slots < above, values, kth))


def rank_order(ids: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same tokens [R, n] put in rank order: by id, then stably by value descending."""
    ids, by_id = torch.sort(ids, dim=-1)
    values = values.gather(1, by_id)
    values, by_value = torch.sort(values, dim=-1, descending=True, stable=True)
    return ids.gather(1, by_value), values


def sorted_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, logits) [R, V]: every token in rank order (a stable sort keeps tied ids ascending)."""
    values, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    return ids, values


def mass_floor(x_max: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """A float32 floor [R, 1] under every token that can weigh anything: x_max - 27 T, rounded down.

    A token below it has y < -26.9 + 2^-51 |x_max / T| < FLOOR in float64 (the rounding of x / T and
    x_max / T costs at most 2^-52 |x_max / T| each), so nothing of non-zero mass lies below; past
    |x_max / T| of 2^50, or with no finite logit, the floor is -inf."""
    top = x_max.to(torch.float64)
    bound = top + (FLOOR - 2.0) * temperature
    near = (top.abs() < _FAR * temperature) & (top > float("-inf"))
    floor = torch.where(near, bound, float("-inf")).to(torch.float32)
    below = torch.nextafter(floor, torch.tensor(float("-inf"), device=floor.device))
    return torch.where(floor.to(torch.float64) > bound, below, floor)

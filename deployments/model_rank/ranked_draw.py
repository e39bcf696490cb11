"""One sampled row's token: the cuts (top-k, top-p, min-p) and the inverse-CDF draw over the likeliest first.

The draw walks the tokens in rank order (likeliest first, ties by lower id) until the cumulative mass passes
u times the kept mass, so it needs only the head of the order, not a sort of the whole vocabulary: it reads
the first CANDIDATES tokens, and further (WIDEN times as many, then the whole order) while the top-p or
min-p cut (which fixes the kept mass) or the draw reach past them. A token's probability is its weight
exp((x - max) / T) over the row's total weight (the top-k set's when top-k is on: only that set is
weighed), computed once for the row in float64, so whichever prefix the walk ends in, every value it reads
is the same and the token is a function of (u, the row, the settings) alone.
"""

from dataclasses import dataclass

import torch

from deployments.messages.step import SeqDraw

CANDIDATES = 64  # the head of the rank order read first; a trained model's mass is nearly all there
WIDEN = 16  # how much a head that is too short grows, once; past that the whole order is sorted


class RankedRow:
    """One row's tokens in rank order with their probabilities, read a prefix at a time."""

    def __init__(self, logits: torch.Tensor, temperature: float, top_k: int) -> None:
        self.scaled = logits.to(torch.float64) / temperature  # [V]
        vocab = self.scaled.shape[0]
        self.limit = top_k if 0 < top_k < vocab else vocab  # the top-k set, or every token
        self.top_ids: torch.Tensor | None = None  # top-k on: the whole set in rank order, weighed alone
        if self.limit < vocab:
            self.top_ids = self.head(self.limit)
            self.weights = torch.exp(self.scaled[self.top_ids] - self.scaled[self.top_ids[0]])  # [k]
        else:
            self.weights = torch.exp(self.scaled - self.scaled.max())  # [V], the likeliest weighs 1
        self.total = self.weights.sum()

    def head(self, count: int) -> torch.Tensor:
        """The first `count` token ids in rank order (ties at the boundary resolved by lower id)."""
        count = min(count, self.limit)
        if self.top_ids is not None:
            return self.top_ids[:count]
        if count >= self.scaled.shape[0]:
            return torch.sort(self.scaled, descending=True, stable=True).indices
        kth = torch.topk(self.scaled, count).values[-1]
        keep = self.scaled >= kth
        if kth == float("-inf"):  # a grammar allows fewer tokens than `count`: the head is those (no sort)
            keep &= self.scaled > kth
        candidates = keep.nonzero().squeeze(1)  # ascending ids: ties keep lower ids first
        order = torch.sort(self.scaled[candidates], descending=True, stable=True).indices
        return candidates[order][:count]

    def prefix(self, count: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(ids, probabilities, whether the prefix holds every token of the set) for the first `count`."""
        ids = self.head(count)
        weights = self.weights[: ids.shape[0]] if self.top_ids is not None else self.weights[ids]
        return ids, weights / self.total, ids.shape[0] >= self.limit


@dataclass
class KeptHead:
    """The kept set as seen from one prefix: its first `size` tokens are in the prefix; `ends` says whether
    the set ends there; `cut` whether top-p or min-p ended it (else it holds every token of non-zero
    probability, whose mass is 1 whatever prefix is looked at)."""

    ids: torch.Tensor
    probs: torch.Tensor  # the prefix's probabilities over the top-k set (or the row)
    size: int
    ends: bool
    cut: bool

    def mass(self) -> float:
        return float(self.probs[: self.size].sum()) if self.cut else 1.0


def kept_head(ids: torch.Tensor, probs: torch.Tensor, complete: bool, draw: SeqDraw) -> KeptHead:
    """Top-p (the smallest prefix whose mass reaches it; the first token always stays), then min-p
    (relative to the likeliest), then only tokens of non-zero probability (grammar-masked ones have none).
    Each keeps a prefix of the rank order, so a cut inside this prefix is where the set ends for any
    longer one."""
    head = KeptHead(ids, probs, probs.shape[0], complete, False)
    if draw.top_p < 1.0:
        before = torch.cumsum(probs, dim=0) - probs
        _cut(head, int((before < draw.top_p).sum().item()), by_setting=True)
    if draw.min_p > 0.0:
        _cut(head, int((probs[: head.size] >= draw.min_p * probs[0]).sum().item()), by_setting=True)
    _cut(head, int((probs[: head.size] > 0).sum().item()), by_setting=False)
    return head


def _cut(head: KeptHead, count: int, by_setting: bool) -> None:
    if count < head.size:
        head.size, head.ends = max(count, 1), True
        head.cut = head.cut or by_setting


def draw_ranked(logits: torch.Tensor, draw: SeqDraw, u: float) -> int:
    """The token whose cumulative kept probability first passes u times the kept mass."""
    ranked = RankedRow(logits, draw.temperature, draw.top_k)
    settings_cut = draw.top_p < 1.0 or draw.min_p > 0.0  # the kept mass is known once their cut is seen
    needed = u  # the mass the walk must see before it can stop (min-p's cut is found by reading, not by mass)
    if settings_cut:
        needed = draw.top_p if draw.min_p <= 0.0 else 0.0
    likeliest = float(1.0 / ranked.total)  # no head of n tokens holds more than n times the top token's mass
    count = CANDIDATES if CANDIDATES * WIDEN * likeliest >= needed else ranked.limit
    while True:
        head = kept_head(*ranked.prefix(count), draw)
        if settings_cut and not head.ends:
            count = _wider(head, ranked.limit, needed)
            continue
        threshold = u * head.mass()
        cdf = torch.cumsum(head.probs[: head.size], dim=0)
        index = int(torch.searchsorted(cdf, torch.tensor([threshold], dtype=cdf.dtype), right=True).item())
        if index < head.size:
            return int(head.ids[index].item())
        if head.ends:  # rounding left the cdf just short of the threshold: the last kept token
            return int(head.ids[head.size - 1].item())
        count = _wider(head, ranked.limit, threshold)


def _wider(head: KeptHead, limit: int, needed: float) -> int:
    """The next head to read: WIDEN times the first, then the whole set. A flat row's mass is spread wide
    and one sort beats growing heads there: when even the longer head could not hold `needed` mass (each of
    its new tokens weighs at most the last one read), the whole set is read at once."""
    count = head.probs.shape[0]
    wider = count * WIDEN
    if count != CANDIDATES or wider * 8 >= limit:
        return limit
    reachable = float(head.probs.sum()) + (wider - count) * float(head.probs[-1])
    return wider if reachable >= needed else limit


def filtered_distribution(logits: torch.Tensor, draw: SeqDraw) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept candidates of one row: (token ids, probabilities summing to 1) likeliest first."""
    ranked = RankedRow(logits, draw.temperature, draw.top_k)
    head = kept_head(*ranked.prefix(ranked.limit), draw)
    return head.ids[: head.size], head.probs[: head.size] / head.mass()

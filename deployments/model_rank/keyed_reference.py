"""The keyed rule as it was first written, row by row on the host in float64: the reference the vectorised
sampler (keyed_draw.py) is held to, token for token (tests/rank/test_keyed_draw.py), and what
`tensorfold bench sampler` times it against. Nothing in the engine calls it.

The draw walks the tokens in rank order (likeliest first, ties by lower id) until the cumulative mass passes
u times the kept mass, so it needs only the head of the order, not a sort of the whole vocabulary: it reads
the first CANDIDATES tokens, and further (WIDEN times as many, then the whole order) while the top-p or
min-p cut (which fixes the kept mass) or the draw reach past them. A token's probability is its weight
exp((x - max) / T) over the row's total weight (the top-k set's when top-k is on: only that set is
weighed), computed once for the row in float64. Its sums run in torch's order on this CPU, which is why
the sampler now counts masses in exact integers instead (docs/engine.md, Keyed sampling).
"""

from dataclasses import dataclass

import torch

from deployments.messages.replies import LogprobRow, PromptLogprobRow
from deployments.messages.step import SeqDraw, StepResult
from deployments.model_rank.sampler import keyed_uniform, unpack_bitmask
from kernels import cpu_layer_ops

CANDIDATES = 64  # the head of the rank order read first; a trained model's mass is nearly all there
WIDEN = 16  # how much a head that is too short grows, once; past that the whole order is sorted


def draw_token(logits: torch.Tensor, draw: SeqDraw) -> int:
    """One row's token: greedy is the argmax (lowest id on ties); else an inverse-CDF keyed draw over the
    kept tokens likeliest first."""
    if draw.temperature <= 0.0:
        return int(torch.argmax(logits).item())
    return draw_ranked(logits, draw, keyed_uniform(draw.seed, draw.reply_position))


def sample_rows(logits: torch.Tensor, draws: list[SeqDraw]) -> list[StepResult]:
    """Each row's token, logprob row and scores, as the sampler computed them row by row on the host."""
    tokens = draw_rows(logits, draws)
    results = [StepResult(token=t) for t in tokens]
    for row, draw in enumerate(draws):
        if draw.want_logprobs is not None:
            results[row].logprobs = logprob_row(logits[row], tokens[row], draw.want_logprobs)
        if draw.score_ids is not None:
            results[row].scores = score_row(logits[row], draw.score_ids)
    return results


def draw_rows(logits: torch.Tensor, draws: list[SeqDraw]) -> list[int]:
    """Each row's token; a constrained row draws among its allowed ids only (ascending, so ties still go to
    the lower id); a mask that allows nothing draws freely. The free greedy rows take one native argmax."""
    tokens: list[int] = [0] * len(draws)
    free_greedy = [i for i, d in enumerate(draws) if d.temperature <= 0.0 and d.allowed is None]
    if free_greedy:
        rows = logits if len(free_greedy) == len(draws) else logits[free_greedy]
        for row, token in zip(free_greedy, _argmax_rows(rows)):
            tokens[row] = int(token)
    for row, draw in enumerate(draws):
        if draw.temperature <= 0.0 and draw.allowed is None:
            continue
        ids = allowed_ids(draw, logits.shape[-1])
        if ids is None:
            tokens[row] = draw_token(logits[row], draw)
        else:
            tokens[row] = int(ids[draw_token(logits[row][ids], draw)].item())
    return tokens


def _argmax_rows(rows: torch.Tensor) -> list[int]:
    if rows.dtype == torch.float32 and rows.dim() == 2 and cpu_layer_ops.supports(rows):
        return cpu_layer_ops.argmax_rows(rows)
    return torch.argmax(rows, dim=-1).tolist()


def allowed_ids(draw: SeqDraw, vocab_size: int) -> torch.Tensor | None:
    if draw.allowed is None:
        return None
    ids = unpack_bitmask(draw.allowed, vocab_size).nonzero().squeeze(1)
    return ids if ids.shape[0] else None


def logprob_row(logits: torch.Tensor, token: int, top: int) -> LogprobRow:
    """The raw distribution at temperature 1 (float64 log-softmax); alternatives likeliest first, ties by id."""
    logprobs = torch.log_softmax(logits.to(torch.float64), dim=-1)
    return LogprobRow(token_id=token, logprob=float(logprobs[token].item()), top=best_tokens(logprobs, top))


def score_row(logits: torch.Tensor, ids: list[int]) -> list[float]:
    logprobs = torch.log_softmax(logits.to(torch.float64), dim=-1)
    return [float(v) for v in logprobs[torch.tensor(ids, dtype=torch.long)].tolist()]


def best_tokens(logprobs: torch.Tensor, top: int) -> list[tuple[int, float]]:
    """The `top` likeliest of one row [V], ties by lower id, without sorting the whole vocabulary."""
    top = min(top, logprobs.shape[0])
    if top <= 0:
        return []
    kth = torch.topk(logprobs, top).values[-1]
    candidates = (logprobs >= kth).nonzero().squeeze(1)  # ascending ids, ties at the k-th value included
    order = torch.sort(logprobs[candidates], descending=True, stable=True).indices[:top]
    return [(int(i), float(logprobs[i])) for i in candidates[order].tolist()]


def prompt_rows(logits: torch.Tensor, next_ids: list[int], top: int) -> list[PromptLogprobRow]:
    """Rows of raw logits [n, V] at prompt positions: each next prompt token's logprob, rank and best tokens."""
    logprobs = torch.log_softmax(logits.to(torch.float64), dim=-1)  # [n, V]
    targets = torch.tensor(next_ids, dtype=torch.long)
    chosen = logprobs.gather(1, targets.unsqueeze(1))  # [n, 1]
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()  # [n]
    return [
        PromptLogprobRow(
            token_id=token, logprob=float(chosen[row, 0]), rank=int(ranks[row]), top=best_tokens(logprobs[row], top)
        )
        for row, token in enumerate(next_ids)
    ]


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

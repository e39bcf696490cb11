"""Keyed sampling: the token at reply position i is a pure function of (seed, i, that row's logits).

No generator state is carried between steps or shared between rows, so a reply does not depend on what
else was batched with it, on chunking, or on preemption. The cuts follow SGLang's order: temperature,
top-k, top-p (on the temperature distribution), then min-p relative to the likeliest token.
"""

import hashlib
import os

import torch

from deployments.messages.replies import LogprobRow, PromptLogprobRow
from deployments.messages.step import SeqDraw, StepResult
from deployments.model_rank.ranked_draw import draw_ranked
from kernels import cpu_layer_ops

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def keyed_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) named by (seed, position): 53 random bits."""
    bits = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (bits >> 11) / float(1 << 53)


def seed_salt() -> int:
    raw = os.environ.get("TENSORFOLD_SEED_SALT", "0").strip() or "0"
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"TENSORFOLD_SEED_SALT must be an integer, got {raw!r}") from exc


def derive_seed(prompt_token_ids: list[int], salt: int = 0) -> int:
    """The sampling key of a request without a seed: the same prompt draws the same samples."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(b"".join(t.to_bytes(4, "little") for t in prompt_token_ids))
    if salt:  # salt 0 keeps the unsalted seeds
        digest.update(salt.to_bytes(16, "little", signed=True))
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


def draw_token(logits: torch.Tensor, draw: SeqDraw) -> int:
    """One row's token: greedy is the argmax (lowest id on ties); else an inverse-CDF keyed draw over the
    kept tokens likeliest first (ranked_draw.py)."""
    if draw.temperature <= 0.0:
        return int(torch.argmax(logits).item())
    return draw_ranked(logits, draw, keyed_uniform(draw.seed, draw.reply_position))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's packed int32 words [W] to a bool mask [vocab_size] (bit j of word w allows id 32 w + j)."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [W, 32]
    flat = bits.reshape(-1).bool()
    if flat.shape[0] < vocab_size:  # logits wider than the tokenizer: the padding ids are never allowed
        flat = torch.cat([flat, torch.zeros(vocab_size - flat.shape[0], dtype=torch.bool)])
    return flat[:vocab_size]


def allowed_ids(draw: SeqDraw, vocab_size: int) -> torch.Tensor | None:
    """The ids a constrained row may draw, ascending (None: unconstrained, or a dead end that allows
    nothing, which draws freely; the matcher then refuses the token and ends that request)."""
    if draw.allowed is None:
        return None
    ids = unpack_bitmask(draw.allowed, vocab_size).nonzero().squeeze(1)
    return ids if ids.shape[0] else None


def logprob_row(logits: torch.Tensor, token: int, top: int) -> LogprobRow:
    """The raw distribution at temperature 1 (float64 log-softmax); alternatives likeliest first, ties by id."""
    logprobs = torch.log_softmax(logits.to(torch.float64), dim=-1)
    return LogprobRow(token_id=token, logprob=float(logprobs[token].item()), top=best_tokens(logprobs, top))


def score_row(logits: torch.Tensor, ids: list[int]) -> list[float]:
    """The raw log-probabilities (float64 log-softmax over the whole vocabulary) of `ids`, in order."""
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
    """Rows of raw logits [n, V] at prompt positions: each next prompt token's logprob, rank and best tokens.

    float64 log-softmax as `logprob_row`; the rank counts every token at or above the prompt token (vLLM's).
    """
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


def sample_rows(logits: torch.Tensor, draws: list[SeqDraw]) -> list[StepResult]:
    """Draw one token per row of `logits` [R, V]; rows are independent of each other.

    Each row's token depends only on its own (masked) logits, seed and position; logprob rows and scores
    describe the unmasked logits, so they are the same whatever the sampling settings.
    """
    tokens = _draw_tokens(logits, draws)
    results = [StepResult(token=t) for t in tokens]
    for row, draw in enumerate(draws):
        if draw.want_logprobs is not None:
            results[row].logprobs = logprob_row(logits[row], tokens[row], draw.want_logprobs)
        if draw.score_ids is not None:
            results[row].scores = score_row(logits[row], draw.score_ids)
    return results


def _draw_tokens(logits: torch.Tensor, draws: list[SeqDraw]) -> list[int]:
    """Each row's token. A constrained row draws among its allowed ids only (ascending, so ties still go
    to the lower id): the same token as over a row with -inf everywhere else, without touching those."""
    tokens: list[int] = [0] * len(draws)
    free_greedy = [i for i, d in enumerate(draws) if d.temperature <= 0.0 and d.allowed is None]
    if free_greedy:
        # Every row greedy (the common batch): argmax in place, without gathering a [R, V] copy first.
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
    """Each row's argmax (lowest id on ties): one native pass on CPU, torch's elsewhere."""
    if rows.dtype == torch.float32 and rows.dim() == 2 and cpu_layer_ops.supports(rows):
        return cpu_layer_ops.argmax_rows(rows)
    return torch.argmax(rows, dim=-1).tolist()

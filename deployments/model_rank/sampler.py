"""Keyed sampling: the token at reply position i is a pure function of (seed, i, that row's logits).

No generator state is carried between steps or shared between rows, so a reply does not depend on what
else was batched with it, on chunking, or on preemption. Every row of a step is drawn at once where its
logits are (keyed_draw.py), and the tokens and the figures asked for come back in one read (docs/engine.md,
Keyed sampling).

Rows are drawn in up to four groups: greedy or sampled, free or under a grammar. A sampled row's uniform is
its key's, computed on the host; a grammar row sends xgrammar's packed bitmask words (a mask that allows
nothing is a dead end and draws freely: the matcher then refuses the token and ends that request).
"""

import hashlib
import os
from dataclasses import dataclass

import torch

from deployments.messages.step import SeqDraw, StepResult
from deployments.model_rank.host_reads import HostRead, HostReads, upload
from deployments.model_rank.keyed_draw import DrawSettings, draw_rows
from deployments.model_rank.logprob_rows import LogprobReads, read_figures
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


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's packed int32 words [..., W] to a bool mask [..., vocab_size] (bit j of word w allows id
    32 w + j; ids past the words, where the logits are wider than the tokenizer, are never allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [..., W, 32]
    flat = bits.reshape(*bitmask.shape[:-1], -1).bool()
    if flat.shape[-1] < vocab_size:
        flat = torch.nn.functional.pad(flat, (0, vocab_size - flat.shape[-1]))
    return flat[..., :vocab_size]


def sample_rows(logits: torch.Tensor, draws: list[SeqDraw]) -> list[StepResult]:
    """Draw one token per row of `logits` [R, V] (float32, on any device); rows are independent of each
    other. Logprob rows and scores describe the unmasked logits, whatever the sampling settings."""
    reads = HostReads()
    pending = start_draws(logits, prepare_draws(draws, logits.device), reads)
    reads.fetch()
    return pending.results()


@dataclass
class RowIndex:
    """Some of a step's rows: their positions on the host and on the device (None: all of them)."""

    rows: list[int]
    index: torch.Tensor | None


@dataclass
class RowGroup:
    """Rows drawn one way: their settings if sampled (else greedy), their packed allowed-id words [Rg, W]
    (int32) if under a grammar."""

    rows: RowIndex
    settings: DrawSettings | None
    words: torch.Tensor | None


@dataclass
class DrawInputs:
    draws: list[SeqDraw]
    groups: list[RowGroup]
    scored: RowIndex  # rows wanting logprobs or scores, read from the raw logits


def build_inputs(draws: list[SeqDraw], uniforms: list[float], device: torch.device) -> DrawInputs:
    """`uniforms`: each draw's keyed uniform (read by sampled rows only)."""
    constrained = [d.allowed is not None and bool(d.allowed.any()) for d in draws]
    groups = []
    for sampled in (False, True):
        for grammar in (False, True):
            rows = [i for i, d in enumerate(draws) if (d.temperature > 0.0) == sampled and constrained[i] == grammar]
            if rows:
                groups.append(_group(draws, uniforms, rows, sampled, grammar, device))
    scored = [i for i, d in enumerate(draws) if d.want_logprobs is not None or d.score_ids is not None]
    return DrawInputs(draws, groups, _row_index(scored, len(draws), device))


def _group(
    draws: list[SeqDraw], uniforms: list[float], rows: list[int], sampled: bool, grammar: bool, device: torch.device
) -> RowGroup:
    settings = _settings([draws[i] for i in rows], [uniforms[i] for i in rows], device) if sampled else None
    words = upload(torch.stack([draws[i].allowed for i in rows]), torch.int32, device) if grammar else None  # type: ignore[misc]
    return RowGroup(_row_index(rows, len(draws), device), settings, words)


def _row_index(rows: list[int], count: int, device: torch.device) -> RowIndex:
    every = rows == list(range(count))
    return RowIndex(rows, None if every or not rows else upload(rows, torch.int64, device))


def _settings(draws: list[SeqDraw], uniforms: list[float], device: torch.device) -> DrawSettings:
    """One host-to-device copy of every sampled row's settings (a top-k past 2^31 cuts nothing anyway)."""
    rows = [[d.temperature, d.top_p, d.min_p, u, min(d.top_k, 1 << 31)] for d, u in zip(draws, uniforms)]
    table = upload(rows, torch.float64, device)  # [R, 5]
    every_row_cuts = all(d.top_k > 0 for d in draws)
    return DrawSettings(table, max(d.top_k for d in draws) if every_row_cuts else 0)


def prepare_draws(draws: list[SeqDraw], device: torch.device) -> DrawInputs:
    """The draws' settings, keys and grammar masks on `device` (copies that wait on nothing)."""
    uniforms = [keyed_uniform(d.seed, d.reply_position) if d.temperature > 0.0 else 0.0 for d in draws]
    return build_inputs(draws, uniforms, device)


@dataclass
class PendingDraws:
    """A step's draws, queued on the device; `results` once the step's reads were fetched."""

    inputs: DrawInputs
    tokens: HostRead
    logprobs: LogprobReads | None
    scores: dict[int, HostRead]

    def results(self) -> list[StepResult]:
        tokens = self.tokens.ints()
        results = [StepResult(token=t) for t in tokens]
        draws, scored = self.inputs.draws, self.inputs.scored.rows
        if self.logprobs is not None:
            tops = [draws[row].want_logprobs or 0 for row in scored]
            for row, logprob_row in zip(scored, self.logprobs.logprob_rows([tokens[r] for r in scored], tops)):
                if draws[row].want_logprobs is not None:
                    results[row].logprobs = logprob_row
        for row, read in self.scores.items():
            results[row].scores = read.floats()
        return results


def start_draws(logits: torch.Tensor, inputs: DrawInputs, reads: HostReads) -> PendingDraws:
    """Queue every row's token and the figures its draw asks for, registered in `reads`."""
    tokens = _tokens(logits, inputs)
    pending = PendingDraws(inputs, reads.add(tokens), None, {})
    if inputs.scored.rows:
        _read_figures(logits, tokens, inputs, reads, pending)
    return pending


def _read_figures(
    logits: torch.Tensor, tokens: torch.Tensor, inputs: DrawInputs, reads: HostReads, pending: PendingDraws
) -> None:
    """The logprob rows and scores the scored rows ask for, from their raw logits."""
    draws, scored = inputs.draws, inputs.scored.rows
    top = max(draws[row].want_logprobs or 0 for row in scored)
    labels = [draws[row].score_ids for row in scored]
    figures, scores = read_figures(
        _take(logits, inputs.scored), _take(tokens, inputs.scored), top, reads, labels=labels
    )
    if any(draws[row].want_logprobs is not None for row in scored):
        pending.logprobs = figures
    pending.scores = {row: read for row, read in zip(scored, scores) if read is not None}


def _tokens(logits: torch.Tensor, inputs: DrawInputs) -> torch.Tensor:
    """Each row's token [R]: greedy rows their argmax, sampled rows their keyed draw; a grammar's rows over
    their allowed ids only (the same token as over a row of -inf elsewhere)."""
    tokens = None
    for group in inputs.groups:
        tokens = _put(logits, tokens, group.rows, _group_tokens(_take(logits, group.rows), group))
    assert tokens is not None, "a step draws at least one row"
    return tokens


def _group_tokens(x: torch.Tensor, group: RowGroup) -> torch.Tensor:
    allowed = None
    if group.words is not None:
        allowed = unpack_bitmask(group.words, x.shape[-1])
        x = torch.where(allowed, x, float("-inf"))
    tokens = _argmax(x) if group.settings is None else draw_rows(x, group.settings)
    if allowed is None:
        return tokens
    # A row whose allowed ids all have -inf (or NaN) logits takes its lowest allowed id.
    none_weighs = ~(x.gather(1, tokens.unsqueeze(1)).squeeze(1) > float("-inf"))
    return torch.where(none_weighs, allowed.to(torch.uint8).argmax(dim=-1), tokens)


def _take(x: torch.Tensor, rows: RowIndex) -> torch.Tensor:
    return x if rows.index is None else x.index_select(0, rows.index)


def _put(logits: torch.Tensor, tokens: torch.Tensor | None, rows: RowIndex, values: torch.Tensor) -> torch.Tensor:
    """`tokens` [R] (None: not yet made) with these rows' values."""
    if rows.index is None:
        return values
    if tokens is None:
        tokens = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    return tokens.index_copy(0, rows.index, values)


def _argmax(rows: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (lowest id on ties): one native pass on CPU, torch's elsewhere."""
    if rows.dtype == torch.float32 and rows.dim() == 2 and cpu_layer_ops.supports(rows):
        return torch.tensor(cpu_layer_ops.argmax_rows(rows), dtype=torch.int64)
    return torch.argmax(rows, dim=-1)

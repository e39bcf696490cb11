"""One step's paged-attention metadata as device tensors, built once from the runner's Python lists.

Attention kernels see a step in two shapes:
- rows: one query token each, with the sequence it belongs to and how many keys it sees (its position + 1).
  Decode steps and short queries (drafted tokens being verified) run as rows, so a drafted token is
  computed by exactly the program that would compute it in a serial decode step.
- prefill sequences: the rest, attended block by block of queries with a causal mask.
"""

import math
from dataclasses import dataclass

import torch

DECODE_MAX_QUERY = 16  # sequences with at most this many new tokens run as rows


@dataclass(frozen=True)
class PagedMeta:
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with block 0 (never read past the context)
    context_lens: torch.Tensor  # [S] int32: cached + new tokens
    query_starts: torch.Tensor  # [S] int32: first flat token of each sequence
    query_lens: torch.Tensor  # [S] int32
    row_token: torch.Tensor  # [R] int32: flat token index of each row
    row_seq: torch.Tensor  # [R] int32: its sequence
    row_len: torch.Tensor  # [R] int32: keys it attends to (position + 1)
    prefill_seqs: torch.Tensor  # [P] int32: sequences run by the prefill kernel
    max_row_len: int  # 0 when there are no rows
    max_prefill_query: int  # 0 when there are no prefill sequences
    num_tokens: int

    @property
    def num_rows(self) -> int:
        return int(self.row_token.shape[0])

    @property
    def num_prefill(self) -> int:
        return int(self.prefill_seqs.shape[0])


def _check_lists(
    query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int
) -> None:
    if not len(query_lens) == len(context_lens) == len(block_tables):
        raise ValueError(
            f"query_lens ({len(query_lens)}), context_lens ({len(context_lens)}) and block_tables "
            f"({len(block_tables)}) must have one entry per sequence"
        )
    for i, (q, c, table) in enumerate(zip(query_lens, context_lens, block_tables)):
        if q < 0 or q > c:
            raise ValueError(f"sequence {i}: {q} new tokens do not fit a context of {c}")
        if math.ceil(c / block_size) > len(table):
            raise ValueError(
                f"sequence {i}: context of {c} tokens needs {math.ceil(c / block_size)} blocks, table has {len(table)}"
            )


def build_paged_meta(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    row_query_limit: int = DECODE_MAX_QUERY,
) -> PagedMeta:
    """Lay the step out for the kernels; one host-to-device copy for all of it."""
    _check_lists(query_lens, context_lens, block_tables, block_size)
    num_seqs = len(query_lens)
    width = max([len(t) for t in block_tables] + [1])
    tables = [t + [0] * (width - len(t)) for t in block_tables]
    starts = [sum(query_lens[:i]) for i in range(num_seqs)]
    rows: list[tuple[int, int, int]] = []  # (token, seq, keys seen)
    prefill: list[int] = []
    for seq, (q, c, start) in enumerate(zip(query_lens, context_lens, starts)):
        if 0 < q <= row_query_limit:
            rows.extend((start + j, seq, c - q + j + 1) for j in range(q))
        elif q > row_query_limit:
            prefill.append(seq)
    flat = [x for t in tables for x in t] + context_lens + starts + query_lens
    flat += [r[0] for r in rows] + [r[1] for r in rows] + [r[2] for r in rows] + prefill
    packed = torch.tensor(flat, dtype=torch.int32).to(device)
    sizes = [num_seqs * width, num_seqs, num_seqs, num_seqs, len(rows), len(rows), len(rows), len(prefill)]
    parts = packed.split(sizes)
    return PagedMeta(
        block_tables=parts[0].view(num_seqs, width),
        context_lens=parts[1],
        query_starts=parts[2],
        query_lens=parts[3],
        row_token=parts[4],
        row_seq=parts[5],
        row_len=parts[6],
        prefill_seqs=parts[7],
        max_row_len=max([r[2] for r in rows] + [0]),
        max_prefill_query=max([query_lens[s] for s in prefill] + [0]),
        num_tokens=sum(query_lens),
    )

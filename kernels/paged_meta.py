"""One step's paged-attention metadata as device tensors: laid out on the host, sent in one copy.

Attention kernels see a step in two shapes:
- rows: one query token each, with the sequence it belongs to and how many keys it sees (its position + 1).
  Decode steps and short queries (drafted tokens being verified) run as rows, so a drafted token is
  computed by exactly the program that would compute it in a serial decode step.
- prefill sequences: the rest, attended block by block of queries with a causal mask.

The host layout (`paged_layout`) and the device tensors (`paged_meta`) are apart so that a runner can send
them with the rest of its step (deployments/model_rank/device_batch.py); `build_paged_meta` does both for
one call. Triton specialises a kernel on every integer argument equal to 1 or divisible by 16 and every
pointer aligned to 16 bytes, so nothing here may let those change from step to step: tables are padded to
whole 16-entry widths, every part starts 64 bytes into its buffer, and the longest row is counted in whole
groups of 8 key splits (the decode kernels' split buffers' strides are 2 x splits floats; docs/engine.md).
"""

import math
from dataclasses import dataclass

import torch

DECODE_MAX_QUERY = 16  # sequences with at most this many new tokens run as rows
ALL_ROWS = 2**31 - 1  # a row limit that runs every token as a row (latent attention)
ALIGN = 16  # elements: block-table widths and every part's start in a packed buffer are multiples of it
# Keys per decode split (kernels/paged_decode_attention.py's KV_SPLIT) times 8: the longest row rounds up
# to it, so the split count is a multiple of 8 and the split buffers keep one specialisation at any length.
ROW_LEN_QUANTUM = 256 * 8


@dataclass(frozen=True)
class PagedMeta:
    block_tables: torch.Tensor  # [S, width] int32, padded past each table (never read past the context)
    context_lens: torch.Tensor  # [S] int32: cached + new tokens
    query_starts: torch.Tensor  # [S] int32: first flat token of each sequence
    query_lens: torch.Tensor  # [S] int32
    row_token: torch.Tensor  # [R] int32: flat token index of each row
    row_seq: torch.Tensor  # [R] int32: its sequence
    row_len: torch.Tensor  # [R] int32: keys it attends to (position + 1)
    prefill_seqs: torch.Tensor  # [P] int32: sequences run by the prefill kernel
    max_row_len: int  # 0 when there are no rows, else a multiple of ROW_LEN_QUANTUM covering every row
    max_prefill_query: int  # 0 when there are no prefill sequences
    num_tokens: int

    @property
    def num_rows(self) -> int:
        return int(self.row_token.shape[0])

    @property
    def num_prefill(self) -> int:
        return int(self.prefill_seqs.shape[0])


@dataclass(frozen=True)
class PagedLayout:
    """A step's PagedMeta on the host, block tables aside (a runner keeps those on the device)."""

    context_lens: list[int]
    query_starts: list[int]
    query_lens: list[int]
    row_token: list[int]
    row_seq: list[int]
    row_len: list[int]
    prefill_seqs: list[int]
    max_row_len: int
    max_prefill_query: int
    num_tokens: int

    def parts(self) -> list[list[int]]:
        """The int32 parts in PagedMeta's order (what `paged_meta` takes back as device tensors)."""
        return [
            self.context_lens,
            self.query_starts,
            self.query_lens,
            self.row_token,
            self.row_seq,
            self.row_len,
            self.prefill_seqs,
        ]


def round_row_len(keys: int) -> int:
    """The longest row as the kernels are launched for it: whole groups of 8 splits (0 stays 0)."""
    return -(-keys // ROW_LEN_QUANTUM) * ROW_LEN_QUANTUM


def check_lists(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int) -> None:
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


def paged_layout(
    query_lens: list[int], context_lens: list[int], row_query_limit: int = DECODE_MAX_QUERY
) -> PagedLayout:
    """Which tokens run as rows and which sequences as prefill, on the host."""
    starts, start = [], 0
    for q in query_lens:
        starts.append(start)
        start += q
    row_token: list[int] = []
    row_seq: list[int] = []
    row_len: list[int] = []
    prefill: list[int] = []
    for seq, (q, c, first) in enumerate(zip(query_lens, context_lens, starts)):
        if 0 < q <= row_query_limit:
            row_token.extend(range(first, first + q))
            row_seq.extend([seq] * q)
            row_len.extend(range(c - q + 1, c + 1))
        elif q > row_query_limit:
            prefill.append(seq)
    return PagedLayout(
        context_lens=list(context_lens),
        query_starts=starts,
        query_lens=list(query_lens),
        row_token=row_token,
        row_seq=row_seq,
        row_len=row_len,
        prefill_seqs=prefill,
        max_row_len=round_row_len(max(row_len, default=0)),
        max_prefill_query=max((query_lens[s] for s in prefill), default=0),
        num_tokens=start,
    )


def paged_meta(layout: PagedLayout, block_tables: torch.Tensor, parts: list[torch.Tensor]) -> PagedMeta:
    """The layout's metadata over device tensors: `parts` are `layout.parts()` on the device, in order."""
    context_lens, query_starts, query_lens, row_token, row_seq, row_len, prefill_seqs = parts
    return PagedMeta(
        block_tables=block_tables,
        context_lens=context_lens,
        query_starts=query_starts,
        query_lens=query_lens,
        row_token=row_token,
        row_seq=row_seq,
        row_len=row_len,
        prefill_seqs=prefill_seqs,
        max_row_len=layout.max_row_len,
        max_prefill_query=layout.max_prefill_query,
        num_tokens=layout.num_tokens,
    )


def aligned_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Where each part starts in a packed buffer (a multiple of ALIGN elements) and the buffer's length."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // ALIGN) * ALIGN
    return offsets, end


def pack(parts: list[list[int]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Lists as views of one device tensor, each starting on an aligned element (one host-to-device copy)."""
    offsets, length = aligned_offsets([len(part) for part in parts])
    flat = [0] * length
    for part, offset in zip(parts, offsets):
        flat[offset : offset + len(part)] = part
    packed = torch.tensor(flat, dtype=dtype).to(device)
    return [packed[offset : offset + len(part)] for part, offset in zip(parts, offsets)]


def table_width(block_tables: list[list[int]]) -> int:
    """The padded width of a step's block tables: a whole number of ALIGN entries, at least one."""
    return -(-max([len(t) for t in block_tables] + [1]) // ALIGN) * ALIGN


def build_paged_meta(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    row_query_limit: int = DECODE_MAX_QUERY,
) -> PagedMeta:
    """Lay the step out for the kernels; one host-to-device copy for all of it (tables included)."""
    check_lists(query_lens, context_lens, block_tables, block_size)
    layout = paged_layout(query_lens, context_lens, row_query_limit)
    width = table_width(block_tables)
    tables = [x for t in block_tables for x in t + [0] * (width - len(t))]
    packed = pack([tables, *layout.parts()], torch.int32, device)
    return paged_meta(layout, packed[0].view(len(block_tables), width), packed[1:])

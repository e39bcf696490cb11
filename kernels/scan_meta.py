"""A step's sequences (recurrent_scan.ScanRows) as device tensors for the recurrent Triton kernels, and the
helpers those kernels share.

Each kernel runs one program per sequence (and head, and tile): it reads the sequence's rows, state slot
and captures from here. Captures are indexed by flat row (compressed rows: the slots row t's states are
copied to are `capture_slots[capture_offsets[t]:capture_offsets[t + 1]]`), so a program looks up each of
its rows in two loads whatever the number of captures. Built once per step (dispatch caches it).
"""

from dataclasses import dataclass

import torch

from kernels._triton import jit, tl
from kernels.recurrent_scan import ScanRows


@dataclass(frozen=True)
class ScanMeta:
    """ScanRows on the kernels' device, int32 views of one tensor (one host-to-device copy)."""

    num_seqs: int  # sequences in the step (the first grid dimension)
    total_rows: int  # T: the flat rows the step's tensors have
    starts: torch.Tensor  # [num_seqs]: first flat row of each sequence
    ends: torch.Tensor  # [num_seqs]: one past each sequence's last row
    slots: torch.Tensor  # [num_seqs]: each sequence's state slot (read first, written back last)
    capture_offsets: torch.Tensor  # [T + 1]: row t's captures are capture_slots[offsets[t]:offsets[t + 1]]
    capture_slots: torch.Tensor  # [max(captures, 1)]: the slots captured rows' states are copied to


def _check_rows(rows: ScanRows, total_rows: int) -> None:
    if not len(rows.starts) == len(rows.ends) == len(rows.slots):
        raise ValueError(f"ScanRows: {len(rows.starts)} starts, {len(rows.ends)} ends, {len(rows.slots)} slots")
    for start, end in zip(rows.starts, rows.ends):
        if not 0 <= start <= end <= total_rows:
            raise ValueError(f"ScanRows: sequence rows [{start}, {end}) outside the step's {total_rows} rows")
    for row, _ in rows.captures:
        if not 0 <= row < total_rows:
            raise ValueError(f"ScanRows: capture at row {row} outside the step's {total_rows} rows")
    running = set(rows.slots)
    if any(slot in running for _, slot in rows.captures):
        raise ValueError("ScanRows: a capture targets a slot a sequence of the step runs in")


def build_scan_meta(rows: ScanRows, total_rows: int, device: torch.device) -> ScanMeta:
    """`rows` over a step of `total_rows` flat rows, on `device`."""
    _check_rows(rows, total_rows)
    ordered = sorted(rows.captures, key=lambda capture: capture[0])  # stable: a row's slots keep their order
    counts = torch.zeros(total_rows + 1, dtype=torch.int64)
    if ordered:
        counts[1:] = torch.bincount(torch.tensor([row for row, _ in ordered]), minlength=total_rows)
    offsets = counts.cumsum(0)
    capture_slots = [slot for _, slot in ordered] or [0]
    n = len(rows.starts)
    host = torch.cat(
        [
            torch.tensor([*rows.starts, *rows.ends, *rows.slots], dtype=torch.int64),
            offsets,
            torch.tensor(capture_slots, dtype=torch.int64),
        ]
    ).to(torch.int32)
    flat = host.to(device)
    bounds = [n, n, n, total_rows + 1, len(capture_slots)]
    starts, ends, slots, capture_offsets, capture_slots_t = flat.split(bounds)
    return ScanMeta(n, total_rows, starts, ends, slots, capture_offsets, capture_slots_t)


@jit
def softplus(x):
    """torch's softplus (beta 1, threshold 20) in float32: x above 20, else log1p(exp(x)), log1p as
    log(u) * e / (u - 1) with u = 1 + e (accurate where 1 + e rounds; e itself where u rounds to 1)."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    rounded = u - 1.0
    log1p = tl.where(rounded == 0.0, e, tl.log(u) * (e / tl.where(rounded == 0.0, 1.0, rounded)))
    return tl.where(x > 20.0, x, log1p)

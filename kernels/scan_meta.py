"""A step's sequences (recurrent_scan.ScanRows) as device tensors for the recurrent Triton kernels, and the
helpers those kernels share.

Each kernel runs one program per sequence (and head, and tile): it reads the sequence's rows, state slot
and captures from here. Captures are indexed by flat row (compressed rows: the slots row t's states are
copied to are `capture_slots[capture_offsets[t]:capture_offsets[t + 1]]`), so a program looks up each of
its rows in two loads whatever the number of captures. Built once per step, before the layers: a runner
sends it with the rest of its step (deployments/model_rank/device_batch.py); `build_scan_meta` builds it alone.
"""

import itertools
from dataclasses import dataclass

import torch

from kernels._triton import jit, tl
from kernels.paged_meta import pack
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


def scan_layout(rows: ScanRows, total_rows: int) -> list[list[int]]:
    """ScanMeta's parts on the host (starts, ends, slots, capture offsets, capture slots), rows checked."""
    _check_rows(rows, total_rows)
    ordered = sorted(rows.captures, key=lambda capture: capture[0])  # stable: a row's slots keep their order
    counts = [0] * (total_rows + 1)
    for row, _ in ordered:
        counts[row + 1] += 1
    offsets = list(itertools.accumulate(counts))
    capture_slots = [slot for _, slot in ordered] or [0]
    return [list(rows.starts), list(rows.ends), list(rows.slots), offsets, capture_slots]


def scan_meta_from(total_rows: int, parts: list[torch.Tensor]) -> ScanMeta:
    """`scan_layout`'s parts as device tensors (int32), in order."""
    starts, ends, slots, capture_offsets, capture_slots = parts
    return ScanMeta(int(starts.shape[0]), total_rows, starts, ends, slots, capture_offsets, capture_slots)


def build_scan_meta(rows: ScanRows, total_rows: int, device: torch.device) -> ScanMeta:
    """`rows` over a step of `total_rows` flat rows, on `device` (one host-to-device copy)."""
    return scan_meta_from(total_rows, pack(scan_layout(rows, total_rows), torch.int32, device))


@jit
def softplus(x):
    """torch's softplus (beta 1, threshold 20) in float32: x above 20, else log1p(exp(x)), log1p as
    log(u) * e / (u - 1) with u = 1 + e (accurate where 1 + e rounds; e itself where u rounds to 1)."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    rounded = u - 1.0
    log1p = tl.where(rounded == 0.0, e, tl.log(u) * (e / tl.where(rounded == 0.0, 1.0, rounded)))
    return tl.where(x > 20.0, x, log1p)

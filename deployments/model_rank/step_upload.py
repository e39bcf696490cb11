"""Host integer lists to the device without a stall: pinned staging, preallocated device buffers, one
non-blocking copy per call (docs/engine.md, The step on a GPU).

`torch.tensor(list, device="cuda")` copies from pageable memory and then waits for the stream: a full stop
of the host behind the device's queue. Here the lists are written into a pinned staging buffer and copied
with `non_blocking=True`, so the host goes on while the copy waits its turn in the stream. A staging buffer
is written again only once its copy has run (its CUDA event says so); when none is free a new one is added
rather than waiting. Every part starts on an aligned element (kernels/paged_meta.py says why). On CPU the
same code runs over plain buffers, where the copy is a memcpy.
"""

from dataclasses import dataclass

import numpy as np
import torch

from kernels.paged_meta import aligned_offsets

DEPTH = 8  # a send's views stay valid through the next DEPTH - 1 sends (a step uses them before that)
MAX_SLOTS = 64  # staging buffers in flight at most before a send waits for the oldest copy


@dataclass
class _Slot:
    host: torch.Tensor  # [capacity] staging, pinned on CUDA
    values: np.ndarray  # the same memory, written from lists
    device: torch.Tensor  # [capacity] where the copy lands unless the send names a destination
    event: "torch.cuda.Event | None" = None  # recorded after the slot's latest copy (CUDA only)

    def ready(self) -> bool:
        return self.event is None or self.event.query()


class StagedUpload:
    """Sends lists of ints of one dtype to one device. The slots are taken in turn, so a send's views stay
    valid through the next DEPTH - 1 sends (the device reads them in stream order before they are written
    again)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, capacity: int = 4096) -> None:
        self.device, self.dtype = device, dtype
        self.capacity = capacity
        self.slots: list[_Slot] = []
        self.turn = 0

    def send(self, parts: list[list[int]], into: torch.Tensor | None = None) -> list[torch.Tensor]:
        """`parts` as device tensors, one copy for all of them: views of a slot's device buffer, or of
        `into` (a preallocated buffer a CUDA graph reads: its parts land at the same offsets every time)."""
        offsets, length = aligned_offsets([len(part) for part in parts])
        if into is not None and into.shape[0] < length:
            raise ValueError(f"a static buffer of {into.shape[0]} elements cannot take {length}")
        slot = self._slot(length)
        for part, offset in zip(parts, offsets):
            slot.values[offset : offset + len(part)] = part
        target = slot.device if into is None else into
        if length:
            target[:length].copy_(slot.host[:length], non_blocking=True)
        if self.device.type == "cuda":
            slot.event = torch.cuda.Event()
            slot.event.record()
        return [target[offset : offset + len(part)] for part, offset in zip(parts, offsets)]

    def _slot(self, length: int) -> _Slot:
        """The next slot in turn, grown to `length`; a new one where its copy is still queued."""
        if len(self.slots) < DEPTH:
            self.slots.append(self._new_slot(length))
            return self.slots[-1]
        index = self.turn
        self.turn = (self.turn + 1) % len(self.slots)
        slot = self.slots[index]
        if not slot.ready():
            if len(self.slots) < MAX_SLOTS:
                self.slots.insert(index, self._new_slot(length))
                self.turn = (index + 1) % len(self.slots)
                return self.slots[index]
            assert slot.event is not None
            slot.event.synchronize()  # MAX_SLOTS copies still queued: the device is far behind anyway
        if slot.host.shape[0] < length:
            slot = self.slots[index] = self._new_slot(length)
        return slot

    @torch.inference_mode(False)  # kept across steps: written inside and outside inference mode alike
    def _new_slot(self, length: int) -> _Slot:
        self.capacity = max(self.capacity, 1 << max(0, length - 1).bit_length())
        pinned = self.device.type == "cuda"
        host = torch.empty(self.capacity, dtype=self.dtype, pin_memory=pinned)
        device = torch.empty(self.capacity, dtype=self.dtype, device=self.device)
        return _Slot(host, host.numpy(), device)

"""What a step's draws need from the host and what their results need back (docs/engine.md).

Each part registers a device tensor and gets a handle; `fetch` copies them all as one float64 vector (the
step's only wait on the device) and each handle then reads its own values. Token ids, ranks and float64
logprobs are all exact in float64. The way in, `upload`, never waits on the device either.
"""

import torch


def upload(values: list | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values (a list or a CPU tensor) as a tensor on `device`; to a GPU from pinned memory, so the
    copy queues behind the forward pass instead of waiting for it."""
    tensor = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class HostReads:
    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._starts: list[int] = []
        self._size = 0
        self._values: list[float] | None = None

    def add(self, tensor: torch.Tensor) -> "HostRead":
        """Register `tensor` (any shape, any real dtype) to be read at `fetch`."""
        flat = tensor.reshape(-1).to(torch.float64)
        self._parts.append(flat)
        self._starts.append(self._size)
        self._size += flat.shape[0]
        return HostRead(self, len(self._parts) - 1)

    def fetch(self) -> None:
        """Copy every registered tensor to the host, all at once."""
        if self._parts:
            self._values = torch.cat(self._parts).cpu().tolist()
        self._parts = []

    def values(self, part: int) -> list[float]:
        if self._values is None:
            raise RuntimeError("HostReads.fetch() has not run")
        start = self._starts[part]
        end = self._starts[part + 1] if part + 1 < len(self._starts) else self._size
        return self._values[start:end]


class HostRead:
    """One registered tensor's values, flat, once its reads were fetched."""

    def __init__(self, reads: HostReads, part: int) -> None:
        self._reads, self._part = reads, part

    def floats(self) -> list[float]:
        return self._reads.values(self._part)

    def ints(self) -> list[int]:
        return [int(v) for v in self._reads.values(self._part)]

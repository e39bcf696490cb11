"""A guard that fails every call which would make the host wait for a GPU, for tests that run on CPU.

On CUDA, `torch.cuda.set_sync_debug_mode("error")` catches syncs; a CPU has none to catch, so this guard
names the calls that sync on a GPU and refuses them while it is on: reading a tensor's values (`item`,
`tolist`, `cpu`, `numpy`, truth values, `int()`), shapes decided by values (`nonzero`, `unique`, `bincount`,
`masked_select`, boolean-mask indexing, `repeat_interleave` by device counts without its output size), copying host data
to the device (`torch.tensor`, `as_tensor`, `from_numpy`) and `torch.cuda.synchronize`. Calls made by
Triton's interpreter (which stands in for the GPU on CPU) are let through, and so are those of the modules
a test names as host-side by design (the pinned staging of deployments/model_rank/step_upload.py, whose
copies are non-blocking: on CPU its host buffers and the device's are the same kind of tensor).
"""

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}
VALUE_SHAPED = {"nonzero", "argwhere", "unique", "unique_consecutive", "bincount", "masked_select"}
UPLOADS = {"tensor", "as_tensor", "from_numpy"}


class HostSync(AssertionError):
    """A call that would stall the host behind the GPU."""


def _name(func: Any) -> str:
    return getattr(func, "__name__", str(func))


def _boolean_index(args: tuple) -> bool:
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


def _caller(allowed: tuple[str, ...]) -> bool:
    """Whether the call comes from an allowed module (the first frame below this guard's and torch's)."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(allowed):
            return True
        if not (module.startswith("torch") or module == __name__):
            return False
        frame = frame.f_back
    return False


class SyncGuard(TorchFunctionMode):
    def __init__(self, host_side: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.allowed = ("triton", *host_side)
        self.paused = False
        self.refused: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        if not self.paused and self._syncs(name, args, kwargs) and not _caller(self.allowed):
            self.refused.append(name)
            raise HostSync(f"{name} would make the host wait for the device")
        return func(*args, **kwargs)

    @staticmethod
    def _syncs(name: str, args: tuple, kwargs: dict) -> bool:
        if name in READS or name in VALUE_SHAPED or name in UPLOADS:
            return True
        if name in ("__getitem__", "__setitem__"):
            return _boolean_index(args)
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
            return isinstance(repeats, torch.Tensor)  # counts on the device: the output's size is read back
        return False

    @contextmanager
    def allowing(self) -> Iterator[None]:
        """Let calls through (the step's one read)."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


@contextmanager
def no_host_sync(host_side: tuple[str, ...] = ()) -> Iterator[SyncGuard]:
    """Refuse every syncing call in the block (and `torch.cuda.synchronize`), but from `host_side` modules."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise HostSync("torch.cuda.synchronize would make the host wait for the device")

    synchronize = torch.cuda.synchronize
    torch.cuda.synchronize = refuse
    try:
        with SyncGuard(host_side) as guard:
            yield guard
    finally:
        torch.cuda.synchronize = synchronize

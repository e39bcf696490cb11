"""The keyed draw and the head of each row's rank order on CPU, one native call each
(kernels/cpu/keyed_draw.c).

In torch the draw is some sixty passes over a row's head in float64 and int64, each an allocation; a flat
row's head is the whole vocabulary, and 16 such rows took over a second. The native call reads each row
once or twice and computes the same masses with the same ops, so it draws torch's token
(tests/rank/test_keyed_draw.py).
"""

import torch

from kernels import cpu_native


def supports(x: torch.Tensor) -> bool:
    """Contiguous float32 [R, V] CPU logits, with the native kernels on."""
    return (
        x.dtype == torch.float32
        and x.dim() == 2
        and x.device.type == "cpu"
        and x.is_contiguous()
        and cpu_native.available()
    )


def keyed_draw(x: torch.Tensor, table: torch.Tensor, bits: int, constants: list[float]) -> torch.Tensor:
    """Each row's keyed token [R] (int64) from logits `x` [R, V] and the rows' settings `table` [R, 5]
    (deployments/model_rank/keyed_draw.py's DrawSettings), masses in units of 2^-bits computed with
    `constants` (keyed_mass.py's MASS_CONSTANTS)."""
    lib = cpu_native.library()
    assert lib is not None
    table = table.to(torch.float64).contiguous()
    constants_t = torch.tensor(constants, dtype=torch.float64)
    tokens = torch.empty(x.shape[0], dtype=torch.int64)
    lib.tf_keyed_draw(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        table.data_ptr(),
        bits,
        constants_t.data_ptr(),
        tokens.data_ptr(),
        cpu_native.threads(),
    )
    if x.shape[0] and int(tokens.min()) < 0:
        raise MemoryError("the keyed draw could not allocate its scratch rows")
    return tokens


def keyed_masses(
    values: torch.Tensor, top: float, temperature: float, bits: int, constants: list[float]
) -> torch.Tensor:
    """The draw's masses [n] (int64) of float32 `values` [n] against the row's largest logit `top`: what
    keyed_mass.masses computes, here to hold the two to each other."""
    lib = cpu_native.library()
    assert lib is not None
    values = values.to(torch.float32).contiguous()
    constants_t = torch.tensor(constants, dtype=torch.float64)
    out = torch.empty(values.shape[0], dtype=torch.int64)
    lib.tf_keyed_masses(
        values.data_ptr(), values.shape[0], top, temperature, bits, constants_t.data_ptr(), out.data_ptr()
    )
    return out


def rank_head(x: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, values) [R, top] of each row's first `top` (<= V) tokens in rank order (NaN as -inf)."""
    lib = cpu_native.library()
    assert lib is not None
    rows, cols = x.shape
    ids = torch.empty(rows, top, dtype=torch.int64)
    values = torch.empty(rows, top, dtype=torch.float32)
    failed = torch.zeros(1, dtype=torch.int64)
    lib.tf_rank_head(
        x.data_ptr(), rows, cols, top, ids.data_ptr(), values.data_ptr(), failed.data_ptr(), cpu_native.threads()
    )
    if int(failed):
        raise MemoryError("the rank order's head could not allocate its scratch rows")
    return ids, values

"""The keyed draw and the head of each row's rank order on CPU, one native call each
(kernels/cpu/keyed_draw.c).

In torch the draw is some sixty passes over a row's head in float64 and int64, each an allocation; a flat
row's head is the whole vocabulary, and 16 such rows took over a second. The native call reads each row
once or twice and computes the same masses with the same ops, so it draws torch's token
(tests/rank/test_keyed_draw.py).
"""

import torch

from kernels import cpu_native

FIRST_WIDTH = 256  # a floor head is read this wide first; wider ones (flat rows) are read again, sorted


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


def rank_head(
    x: torch.Tensor, top_k: torch.Tensor, temperature: torch.Tensor | None, margin: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, values) [R, N] of each row's first tokens in rank order (NaN as -inf), padded with id 0 and
    -inf: the first top_k [R, 1] (int64; 0 or >= V: all) among those at or above the mass floor at
    `temperature` [R, 1] (float64; None: no floor), `margin` being that floor's distance in units of T."""
    rows, cols = x.shape
    top_k = top_k.reshape(rows).to(torch.int64).contiguous()
    if temperature is not None:
        temperature = temperature.reshape(rows).to(torch.float64).contiguous()
    limits = top_k.clamp(min=0).masked_fill(top_k <= 0, cols).clamp(max=cols)
    width = int(limits.max()) if temperature is None else min(int(limits.max()), FIRST_WIDTH)
    ids, values, counts = _call(x, top_k, temperature, margin, max(width, 1))
    if int(counts.min()) < 0:
        raise MemoryError("the sampler's rank head could not allocate its scratch rows")
    longest = max(int(counts.max()), 1)
    if longest > ids.shape[1]:
        ids, values, counts = _call(x, top_k, temperature, margin, longest)
    return ids[:, :longest], values[:, :longest]


def _call(
    x: torch.Tensor, top_k: torch.Tensor, temperature: torch.Tensor | None, margin: float, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lib = cpu_native.library()
    assert lib is not None
    rows, cols = x.shape
    ids = torch.empty(rows, width, dtype=torch.int64)
    values = torch.empty(rows, width, dtype=torch.float32)
    counts = torch.empty(rows, dtype=torch.int64)
    lib.tf_rank_head(
        x.data_ptr(),
        rows,
        cols,
        top_k.data_ptr(),
        None if temperature is None else temperature.data_ptr(),
        margin,
        width,
        ids.data_ptr(),
        values.data_ptr(),
        counts.data_ptr(),
        cpu_native.threads(),
    )
    return ids, values, counts

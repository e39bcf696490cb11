"""The recurrent layers' per-token work over a step's sequences (plain torch: the reference and CPU path).

Gated DeltaNet and Mamba2 layers keep, per sequence, a state slot in two pools: the causal conv's last
K - 1 inputs and a float32 recurrent state. A step hands each layer its rows flat [T, ...] with `ScanRows`
(which rows belong to which sequence and slot, and which rows' states are captured into other slots).

Exactness: every token runs one fixed sequence of ops on fixed-shape tensors (the recurrent form, token after
token per sequence), so its result is the same whatever chunk or batch it arrives in. Native and Triton
kernels (dispatch.py) compute each token in their own fixed order and are checked against these.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ScanRows:
    """A step's sequences as the recurrent kernels see them."""

    starts: tuple[int, ...]  # first flat row of each sequence
    ends: tuple[int, ...]  # one past each sequence's last row
    slots: tuple[int, ...]  # each sequence's state slot: read before its first row, advanced in place
    captures: tuple[tuple[int, int], ...] = ()  # (flat row, slot): the states after that row copied to slot

    def captures_in(self, index: int) -> dict[int, list[int]]:
        """Sequence `index`'s captures as {row offset in the sequence: [slots]}."""
        found: dict[int, list[int]] = {}
        for row, slot in self.captures:
            if self.starts[index] <= row < self.ends[index]:
                found.setdefault(row - self.starts[index], []).append(slot)
        return found


def history_after(history: torch.Tensor, x: torch.Tensor, row: int) -> torch.Tensor:
    """The K - 1 inputs ending at `row` of `x` [n, C], following `history` [K - 1, C]: [K - 1, C]."""
    width = history.shape[0]
    return torch.cat([history.to(x.dtype), x[: row + 1]])[-width:] if width else history


def causal_conv(
    x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The depthwise causal conv of `x` [n, C] after `history` [K - 1, C] with `weight` [C, K]: [n, C]
    float32, each output the taps summed oldest first."""
    inputs = torch.cat([history.to(x.dtype), x])  # [K - 1 + n, C]
    kernel, count = weight.shape[1], x.shape[0]
    out = inputs[0:count].float() * weight[:, 0].float()
    for tap in range(1, kernel):
        out = out + inputs[tap : tap + count].float() * weight[:, tap].float()
    return out if bias is None else out + bias.float()


def causal_conv_scan(
    x: torch.Tensor, history_pool: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: ScanRows
) -> torch.Tensor:
    """Each sequence's rows of `x` [T, C] through the conv after its slot's history (history_pool [S, K - 1, C],
    advanced in place; captured rows' histories copied to their slots): [T, C] float32."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for index, (start, end, slot) in enumerate(zip(rows.starts, rows.ends, rows.slots)):
        if end == start:
            continue
        history, part = history_pool[slot], x[start:end]
        out[start:end] = causal_conv(part, history, weight, bias)
        for row, targets in rows.captures_in(index).items():
            for target in targets:
                history_pool[target].copy_(history_after(history, part, row))
        history.copy_(history_after(history, part, end - start - 1))
    return out


def gated_delta_scan(
    state_pool: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    beta: torch.Tensor,
    neg_a: torch.Tensor,
    dt_bias: torch.Tensor,
    rows: ScanRows,
) -> torch.Tensor:
    """The gated delta rule per token. state_pool [S, Hv, Dk, Dv] float32 (advanced in place); q, k [T, Hv, Dk]
    and v [T, Hv, Dv] float32; a [T, Hv] (model dtype, before dt_bias); beta [T, Hv] float32; neg_a [Hv]
    (-exp(A_log)) float32; dt_bias [Hv]. Returns o [T, Hv, Dv] float32."""
    out = torch.empty_like(v)
    for index, (start, end, slot) in enumerate(zip(rows.starts, rows.ends, rows.slots)):
        if end == start:
            continue
        captures, state = rows.captures_in(index), state_pool[slot].clone()
        for offset, t in enumerate(range(start, end)):
            # Per token on fixed shapes: softplus's bits then never depend on where the row sat in a batch.
            decay = torch.exp(neg_a * F.softplus(a[t].float() + dt_bias))  # [Hv]
            state.mul_(decay[:, None, None])
            remembered = (state * k[t, :, :, None]).sum(dim=-2)  # [Hv, Dv]
            delta = (v[t] - remembered) * beta[t, :, None]
            state.add_(k[t, :, :, None] * delta[:, None, :])
            out[t] = (state * q[t, :, :, None]).sum(dim=-2)
            for target in captures.get(offset, ()):
                state_pool[target].copy_(state)
        state_pool[slot].copy_(state)
    return out


def kda_scan(
    state_pool: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    rows: ScanRows,
) -> torch.Tensor:
    """Kimi delta attention's rule per token: Gated DeltaNet's with one decay per key channel, not per head.
    state_pool [S, H, Dk, Dv] float32 (advanced in place); q, k [T, H, Dk] float32 (l2-normalised, q scaled);
    v [T, H, Dv] float32; g [T, H, Dk] float32 log-decays (<= 0); beta [T, H] float32. Per head:
        S = S * exp(g)[:, None];  S = S + k (x) beta * (v - k S);  o = q S
    Returns o [T, H, Dv] float32."""
    out = torch.empty_like(v)
    for index, (start, end, slot) in enumerate(zip(rows.starts, rows.ends, rows.slots)):
        if end == start:
            continue
        captures, state = rows.captures_in(index), state_pool[slot].clone()
        for offset, t in enumerate(range(start, end)):
            state.mul_(torch.exp(g[t])[:, :, None])
            remembered = (state * k[t, :, :, None]).sum(dim=-2)  # [H, Dv]
            delta = (v[t] - remembered) * beta[t, :, None]
            state.add_(k[t, :, :, None] * delta[:, None, :])
            out[t] = (state * q[t, :, :, None]).sum(dim=-2)
            for target in captures.get(offset, ()):
                state_pool[target].copy_(state)
        state_pool[slot].copy_(state)
    return out


def mamba2_scan(
    state_pool: torch.Tensor,
    x: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    a: torch.Tensor,
    d: torch.Tensor,
    time_step_limit: tuple[float, float],
    rows: ScanRows,
) -> torch.Tensor:
    """Mamba2's selective state update per token. state_pool [S, H, P, N] float32 (advanced in place); x
    [T, H, P], b and c [T, H, N] float32 (groups already repeated over their heads); dt [T, H] (model dtype,
    before dt_bias); dt_bias [H]; a (-exp(A_log)) and d [H] float32. Returns y [T, H, P] float32."""
    out = torch.empty_like(x)
    low, high = time_step_limit
    clamp = low > 0.0 or high != float("inf")
    for index, (start, end, slot) in enumerate(zip(rows.starts, rows.ends, rows.slots)):
        captures, state = rows.captures_in(index), state_pool[slot]
        for offset, t in enumerate(range(start, end)):
            step = F.softplus(dt[t] + dt_bias).float()  # in the model dtype, as transformers computes it
            if clamp:
                step = step.clamp(low, high)
            state.mul_(torch.exp(step * a)[:, None, None])
            state.add_((x[t] * step[:, None])[:, :, None] * b[t, :, None, :])
            out[t] = torch.bmm(state, c[t, :, :, None])[:, :, 0] + d[:, None] * x[t]
            for target in captures.get(offset, ()):
                state_pool[target].copy_(state)
    return out

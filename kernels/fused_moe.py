"""Fused MoE experts: the routed (token, expert) pairs as one grouped GEMM pass per projection.

Pairs are sorted by expert and each expert's run padded to BLOCK_M, so a program's BLOCK_M rows share
one expert's weights. Pass 1 computes act(x W_gate^T) * (x W_up^T) for those rows, act SiLU (optionally
with GLM's clamped gate and up, `limit`) or GELU-tanh (Gemma 4), or, for experts without a gate,
Nemotron-H's relu(x W_up^T)^2; pass 2 multiplies by W_down^T and the routing weight and writes each pair's
row to its own slot; a last pass sums a token's k slots in slot order. No atomics anywhere: a token's
result does not depend on the other tokens (batch invariance), only on its own routing. Nothing reads the
device from the host either (the sort is device-side), so a step holding it needs no sync and a CUDA graph
can hold it.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels._triton import cdiv, dot_precision, jit, next_pow2, tl
from kernels.activation import gelu_tanh, silu
from kernels.checks import (
    FLOAT_DTYPES,
    check_device,
    check_dim,
    check_dtype,
    check_last_contiguous,
    check_same_dtype,
    output_buffer,
)

BLOCK_M = 16  # pair rows per program (decode batches route ~1 token per expert: keep padding small)
BLOCK_N = 64  # output features per program
BLOCK_K = 64  # reduction step

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": silu, "gelu_tanh": gelu_tanh}


@jit
def _gate_up_kernel(
    x_ptr,  # [T, H]
    gate_ptr,  # [E, I, H]
    up_ptr,  # [E, I, H]
    inter_ptr,  # [T * k, I]: one row per pair
    pairs_ptr,  # [capacity] int32: pair ids sorted by expert, padded with num_pairs
    block_expert_ptr,  # [capacity / BLOCK_M] int32
    num_pairs,
    num_experts,
    hidden,
    inter_size,
    stride_xt,
    stride_ge,
    stride_gi,
    stride_ue,
    stride_ui,
    stride_ip,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,  # False: relu(x W_up^T)^2, gate_ptr unread
    GELU: tl.constexpr,  # the gate's activation: GELU-tanh (True) or SiLU
    CLAMP: tl.constexpr,  # SiLU only: gate clamped to max=limit, up to [-limit, limit] first
    limit,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= num_experts:  # capacity is sized for the worst case; the tail is empty
        return
    pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter_size
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + kk[None, :], mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        if GATED:
            w_gate = tl.load(
                gate_ptr + expert * stride_ge + cols[None, :] * stride_gi + kk[:, None], mask=w_mask, other=0.0
            )
            acc_gate = tl.dot(a, w_gate, acc_gate, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        w_up = tl.load(up_ptr + expert * stride_ue + cols[None, :] * stride_ui + kk[:, None], mask=w_mask, other=0.0)
        acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
    if GATED and GELU:  # g (1 + tanh(u)) / 2 * up = g / (1 + exp(-2u)) * up, u = sqrt(2 / pi) (g + 0.044715 g^3)
        inner = 0.7978845608028654 * (acc_gate + 0.044715 * acc_gate * acc_gate * acc_gate)
        hidden_act = acc_gate / (1.0 + tl.exp(-2.0 * inner)) * acc_up
    elif GATED:
        if CLAMP:
            acc_gate = tl.minimum(acc_gate, limit)
            acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        hidden_act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # silu(gate) * up
    else:
        relu = tl.maximum(acc_up, 0.0)
        hidden_act = relu * relu  # relu(up)^2
    dst = inter_ptr + pairs.to(tl.int64)[:, None] * stride_ip + cols[None, :]
    tl.store(dst, hidden_act.to(inter_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


@jit
def _down_kernel(
    inter_ptr,  # [T * k, I]
    down_ptr,  # [E, H, I]
    route_w_ptr,  # [T * k] float32
    pair_out_ptr,  # [T * k, H]
    pairs_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    hidden,
    inter_size,
    stride_ip,
    stride_de,
    stride_dh,
    stride_op,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= num_experts:
        return
    pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    rows = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < inter_size
        a = tl.load(
            inter_ptr + rows[:, None] * stride_ip + kk[None, :], mask=pair_ok[:, None] & k_ok[None, :], other=0.0
        )
        w = tl.load(
            down_ptr + expert * stride_de + cols[None, :] * stride_dh + kk[:, None],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    route_w = tl.load(route_w_ptr + rows, mask=pair_ok, other=0.0)
    out = acc * route_w[:, None]
    tl.store(
        pair_out_ptr + rows[:, None] * stride_op + cols[None, :],
        out.to(pair_out_ptr.dtype.element_ty),
        mask=pair_ok[:, None] & col_ok[None, :],
    )


@jit
def _sum_slots_kernel(pair_out_ptr, out_ptr, hidden, stride_p, stride_o, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[t] = sum_j pair_out[t * k + j], j in order (float32)."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < hidden
    total = tl.load(pair_out_ptr + token * TOP_K * stride_p + cols, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOP_K):
        total += tl.load(pair_out_ptr + (token * TOP_K + j) * stride_p + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_o + cols, total.to(out_ptr.dtype.element_ty), mask=ok)


def sort_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair ids (t * k + j) grouped by expert, each run padded to block_m: (pairs [capacity], block_expert).

    Device-side only (no host sync): capacity is the worst case, and blocks past the used ones get expert
    id num_experts, which the kernels skip.
    """
    num_pairs = ids.numel()
    flat = ids.flatten()  # [P]
    order = torch.argsort(flat, stable=True)  # pairs in expert order, token order within an expert
    # Counted by scatter: bincount reads the largest id back to the host first, a sync on CUDA.
    counts = torch.zeros(num_experts, dtype=flat.dtype, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts  # each expert's first position in `order`
    sorted_expert = flat[order]
    rank = torch.arange(num_pairs, device=ids.device) - first[sorted_expert]
    capacity = cdiv(min(num_pairs + num_experts * (block_m - 1), num_pairs * block_m), block_m) * block_m
    pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=ids.device)
    pairs[(padded_end - padded)[sorted_expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, capacity, block_m, device=ids.device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return pairs, block_expert


def fused_moe_torch(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    linear: Linear = F.linear,
    activation: str = "silu",
    limit: float | None = None,
) -> torch.Tensor:
    """layers/moe.py's Experts.forward: x [T, H], weights/ids [T, k], gate/up [E, I, H], down [E, H, I] -> [T, H].

    `linear` is the layer's batch-invariant matmul, so the CPU path keeps its bits; `activation` names the
    gate's (ACTIVATIONS); `limit` (SiLU only, GLM's swiglu_limit): the gate clamped to max=limit and up to
    [-limit, limit] before silu(gate) * up.
    """
    check_swiglu_limit(activation, True, limit)
    act = ACTIVATIONS[activation]
    top_k = ids.shape[1]
    slots = torch.zeros(x.shape[0], top_k, x.shape[1], dtype=x.dtype, device=x.device)  # [T, k, H]
    for expert in torch.unique(ids).tolist():
        tokens, slot = torch.nonzero(ids == expert, as_tuple=True)
        rows = x[tokens]  # [n, H]
        gate, up = linear(rows, gate_proj[expert]), linear(rows, up_proj[expert])
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        hidden = act(gate) * up
        out = linear(hidden, down_proj[expert])  # [n, H]
        slots[tokens, slot] = (out * weights[tokens, slot, None]).to(x.dtype)
    total = slots[:, 0]
    for j in range(1, top_k):
        total = total + slots[:, j]  # fixed per-token order
    return total


def relu2_moe_torch(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    linear: Linear,
) -> torch.Tensor:
    """Experts without a gate (Nemotron-H): x [T, D], weights (float32) / ids [T, k], up [E, I, D], down [E, D, I]
    -> [T, D] in x's dtype. Each pair's weighted output is kept in float32, as transformers accumulates."""
    wide = torch.promote_types(x.dtype, torch.float32)  # float32 (float64 for a float64 reference)
    slots = torch.zeros(x.shape[0], ids.shape[1], x.shape[1], dtype=wide, device=x.device)  # [T, k, D]
    for expert in torch.unique(ids).tolist():
        tokens, slot = torch.nonzero(ids == expert, as_tuple=True)
        hidden = torch.square(F.relu(linear(x[tokens], up_proj[expert])))  # [n, I]
        out = linear(hidden, down_proj[expert])  # [n, D]
        slots[tokens, slot] = out * weights[tokens, slot, None]
    total = slots[:, 0]
    for j in range(1, ids.shape[1]):
        total = total + slots[:, j]  # fixed per-token order
    return total.to(x.dtype)


def check_swiglu_limit(activation: str, gated: bool, limit: float | None) -> None:
    """A swiglu limit clamps a SiLU gate and its up: refused for other experts rather than ignored."""
    if limit is not None and not (gated and activation == "silu"):
        raise ValueError(f"a swiglu limit applies to gated SiLU experts only, not {activation!r} (gated={gated})")


def _check(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate: torch.Tensor | None,
    up: torch.Tensor,
    down: torch.Tensor,
) -> None:
    if x.dim() != 2 or up.dim() != 3 or (gate is not None and gate.shape != up.shape) or down.dim() != 3:
        raise ValueError(
            f"expected x [T, H], gate/up [E, I, H], down [E, H, I]; got {tuple(x.shape)}, "
            f"{None if gate is None else tuple(gate.shape)}, {tuple(up.shape)}, {tuple(down.shape)}"
        )
    num_experts, inter, hidden = up.shape
    check_dim("x", x, 1, hidden, "features")
    check_dim("down_proj", down, 0, num_experts, "experts")
    check_dim("down_proj", down, 1, hidden, "output features")
    check_dim("down_proj", down, 2, inter, "intermediate features")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [T, k] for T = {x.shape[0]}"
        )
    check_dtype("x", x, FLOAT_DTYPES)
    projections = [("up_proj", up), ("down_proj", down), *([] if gate is None else [("gate_proj", gate)])]
    check_same_dtype("x and the expert projections", x, *(t for _, t in projections))
    check_dtype("ids", ids, (torch.int64, torch.int32))
    for name, t in (("x", x), *projections):
        check_last_contiguous(name, t)
    check_device(("x", x), ("weights", weights), ("ids", ids), *projections)


def fused_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_proj: torch.Tensor | None,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    block_m: int = BLOCK_M,
    out: torch.Tensor | None = None,
    activation: str = "silu",
    limit: float | None = None,
) -> torch.Tensor:
    """Triton experts: same arguments and result as fused_moe_torch (without `linear`): [T, H] (into `out`);
    `gate_proj` None: relu^2 experts, as relu2_moe_torch (each pair's weighted row kept in float32)."""
    _check(x, weights, ids, gate_proj, up_proj, down_proj)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, not {activation!r}")
    check_swiglu_limit(activation, gate_proj is not None, limit)
    num_experts, inter, hidden = up_proj.shape
    gated = gate_proj is not None
    gate = gate_proj if gate_proj is not None else up_proj  # an unread stand-in without a gate
    tokens, top_k = ids.shape
    num_pairs = tokens * top_k
    out = output_buffer(out, "out", (tokens, hidden), x.dtype, x.device)
    if tokens == 0:
        return out
    pairs, block_expert = sort_by_expert(ids, num_experts, block_m)
    route_w = weights.reshape(-1).to(torch.float32)  # [P]
    inter_rows = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [P, I]
    pair_out = torch.empty(num_pairs, hidden, dtype=x.dtype if gated else torch.float32, device=x.device)  # [P, H]
    precision = dot_precision(x.dtype)
    _gate_up_kernel[(block_expert.numel(), cdiv(inter, BLOCK_N))](
        x,
        gate,
        up_proj,
        inter_rows,
        pairs,
        block_expert,
        num_pairs,
        num_experts,
        hidden,
        inter,
        x.stride(0),
        gate.stride(0),
        gate.stride(1),
        up_proj.stride(0),
        up_proj.stride(1),
        inter_rows.stride(0),
        TOP_K=top_k,
        GATED=gated,
        GELU=activation == "gelu_tanh",
        CLAMP=limit is not None,
        limit=0.0 if limit is None else float(limit),
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DOT_PRECISION=precision,
    )
    _down_kernel[(block_expert.numel(), cdiv(hidden, BLOCK_N))](
        inter_rows,
        down_proj,
        route_w,
        pair_out,
        pairs,
        block_expert,
        num_pairs,
        num_experts,
        hidden,
        inter,
        inter_rows.stride(0),
        down_proj.stride(0),
        down_proj.stride(1),
        pair_out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DOT_PRECISION=precision,
    )
    block_h = min(1024, next_pow2(hidden))
    _sum_slots_kernel[(tokens, cdiv(hidden, block_h))](
        pair_out, out, hidden, pair_out.stride(0), out.stride(0), TOP_K=top_k, BLOCK_N=block_h
    )
    return out

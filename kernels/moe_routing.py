"""GLM's MoE routing in one pass per token: sigmoid scores, correction bias, group pick, top-k, weights.

Matches layers/moe.py's Router._grouped_sigmoid given the router logits (the router GEMM stays a linear
layer): experts are chosen by score + bias, within the topk_group groups whose best two choices sum
highest, best first; the weights are the unbiased sigmoid scores of the chosen experts, optionally
normalised, times routed_scaling_factor. Ties pick the lower expert id.
"""

import torch

from kernels._triton import jit, next_pow2, tl
from kernels.activation import sigmoid
from kernels.checks import FLOAT_DTYPES, check_device, check_dim, check_dtype, check_last_contiguous, output_buffer


@jit
def _top_groups(choice, BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr, TOPK_GROUP: tl.constexpr):
    """choice [G, EG] (-inf padded) -> [G] mask of the TOPK_GROUP groups whose two best experts sum highest."""
    col = tl.arange(0, BLOCK_EG)[None, :]
    best = tl.max(choice, axis=1)
    best_col = tl.min(tl.where(choice == best[:, None], col, BLOCK_EG), axis=1)
    second = tl.max(tl.where(col == best_col[:, None], float("-inf"), choice), axis=1)
    group_score = best + second  # [G]
    g = tl.arange(0, BLOCK_G)
    keep = g < 0
    for _ in tl.static_range(TOPK_GROUP):
        top = tl.max(group_score, axis=0)
        pick = tl.min(tl.where(group_score == top, g, BLOCK_G), axis=0)
        keep = keep | (g == pick)
        group_score = tl.where(g == pick, float("-inf"), group_score)
    return keep


@jit
def _grouped_topk_kernel(
    logits_ptr,  # [T, E] float32
    bias_ptr,  # [E] float32
    weights_ptr,  # [T, K] float32
    ids_ptr,  # [T, K] int64
    num_experts,
    stride_lt,
    stride_wt,
    stride_it,
    routed_scaling_factor,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_EG: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    per_group = num_experts // N_GROUP
    g = tl.arange(0, BLOCK_G)[:, None]
    j = tl.arange(0, BLOCK_EG)[None, :]
    ok = (g < N_GROUP) & (j < per_group)
    big = num_experts + 1  # padded lanes get an id no pick can equal
    expert = tl.where(ok, g * per_group + j, big)  # [G, EG]
    logits = tl.load(logits_ptr + token * stride_lt + expert, mask=ok, other=0.0)
    scores = 1.0 / (1.0 + tl.exp(-logits))  # sigmoid composed as the torch path composes it
    choice = tl.where(ok, scores + tl.load(bias_ptr + expert, mask=ok, other=0.0), float("-inf"))
    if N_GROUP > 1:
        choice = tl.where(_top_groups(choice, BLOCK_G, BLOCK_EG, TOPK_GROUP)[:, None], choice, float("-inf"))
    slot = tl.arange(0, BLOCK_K)
    picked_w = tl.zeros([BLOCK_K], tl.float32)
    picked_id = tl.zeros([BLOCK_K], tl.int64)
    for k in tl.static_range(TOP_K):
        top = tl.max(tl.max(choice, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(choice == top, expert, big), axis=1), axis=0)
        weight = tl.sum(tl.sum(tl.where(expert == pick, scores, 0.0), axis=1), axis=0)
        picked_w = tl.where(slot == k, weight, picked_w)
        picked_id = tl.where(slot == k, pick.to(tl.int64), picked_id)
        choice = tl.where(expert == pick, float("-inf"), choice)
    if NORMALIZE:
        picked_w = picked_w / (tl.sum(tl.where(slot < TOP_K, picked_w, 0.0), axis=0) + 1e-20)
    tl.store(weights_ptr + token * stride_wt + slot, picked_w * routed_scaling_factor, mask=slot < TOP_K)
    tl.store(ids_ptr + token * stride_it + slot, picked_id, mask=slot < TOP_K)


def grouped_topk_torch(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """layers/moe.py's grouped sigmoid routing from router logits [T, E] (float32) -> weights, ids [T, k]."""
    num_experts = logits.shape[1]
    scores = sigmoid(logits)  # [T, E]
    choice = scores + correction_bias
    if n_group > 1:
        grouped = choice.view(-1, n_group, num_experts // n_group)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        keep = keep[:, :, None].expand_as(grouped).reshape(-1, num_experts)  # [T, E]
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def grouped_topk(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    weights: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton routing: same arguments and results as grouped_topk_torch (weights float32, ids int64),
    into `weights` / `ids` [T, k] if given."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    num_tokens, num_experts = logits.shape
    check_dtype("logits", logits, (torch.float32,))
    check_dtype("correction_bias", correction_bias, FLOAT_DTYPES)  # added in float32, as the torch path promotes
    check_dim("correction_bias", correction_bias, 0, num_experts, "experts")
    if num_experts % n_group or not 0 < topk_group <= n_group or not 0 < top_k <= num_experts:
        raise ValueError(
            f"bad routing: {num_experts} experts, {n_group} groups, topk_group {topk_group}, top_k {top_k}"
        )
    if n_group > 1 and num_experts // n_group < 2:
        raise ValueError("group scores sum each group's best two experts: groups need at least two experts")
    check_last_contiguous("logits", logits)
    check_device(("logits", logits), ("correction_bias", correction_bias))
    weights = output_buffer(weights, "weights", (num_tokens, top_k), torch.float32, logits.device)
    ids = output_buffer(ids, "ids", (num_tokens, top_k), torch.int64, logits.device)
    if num_tokens:
        _grouped_topk_kernel[(num_tokens,)](
            logits,
            correction_bias.to(torch.float32).contiguous(),
            weights,
            ids,
            num_experts,
            logits.stride(0),
            weights.stride(0),
            ids.stride(0),
            float(routed_scaling_factor),
            N_GROUP=n_group,
            TOPK_GROUP=topk_group,
            TOP_K=top_k,
            NORMALIZE=bool(norm_topk_prob),
            BLOCK_G=next_pow2(n_group),
            BLOCK_EG=next_pow2(num_experts // n_group),
            BLOCK_K=next_pow2(top_k),
        )
    return weights, ids

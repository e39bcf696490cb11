"""Sparse MLA (DeepSeek sparse attention's attention half): each query reads only the cached tokens its
indexer selected, in the absorbed form of kernels/mla_decode.py, so no latent is expanded per head.

Per sequence, the union of its queries' selections is gathered once from the paged latent cache ([C + R]
rows); with W_UK_h, W_UV_h head h's rows of kv_b_proj,
    score_h(q, t) = (W_UK_h^T q_nope_h) . c_t + q_rope_h . k_rope_t,   out_h = W_UV_h sum_t p_t c_t
over the query's own selected t. A decode row reads at most its selection (index_topk tokens, plus a k-pool
tail), whatever the context length. Computed in float64 on CPU (as attention_torch.causal_attention, so a
row's result does not depend on the rows beside it), else in the model dtype.
"""

import torch

from kernels.attention_torch import sequence_spans


def gather_rows(cache: torch.Tensor, block_table: list[int], positions: torch.Tensor) -> torch.Tensor:
    """The cached rows of one sequence at `positions` [n]: cache [blocks, bs, W] -> [n, W]."""
    block_size = cache.shape[1]
    table = torch.tensor(block_table, dtype=torch.long, device=cache.device)
    slots = table[positions // block_size] * block_size + positions % block_size
    return cache.reshape(-1, cache.shape[2]).index_select(0, slots)


def sparse_mla_torch(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    latent_cache: torch.Tensor,
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    scale: float,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    keeps: list[torch.Tensor],
) -> torch.Tensor:
    """q_nope [T, H, nope], q_rot [T, H, R] (rotated), latent_cache [blocks, bs, C + R (+ more columns)],
    w_uk [H, nope, C], w_uv [H, v, C], keeps: each sequence's selection [Tq, context] -> [T, H, v]."""
    tokens, heads = q_nope.shape[:2]
    latent, rope = w_uk.shape[2], q_rot.shape[2]
    compute = torch.float64 if q_nope.device.type == "cpu" or q_nope.dtype == torch.float32 else q_nope.dtype
    uk, uv = w_uk.to(compute), w_uv.to(compute)
    out = q_nope.new_empty(tokens, heads, w_uv.shape[1])
    spans = zip(sequence_spans(query_lens), block_tables, keeps)
    for (start, end), table, keep in spans:
        if end == start:
            continue
        chosen = keep.any(0).nonzero()[:, 0]  # [n] positions read by some query, ascending
        rows = gather_rows(latent_cache, table, chosen)[:, : latent + rope].to(compute)
        c, k_rope = rows.split([latent, rope], dim=-1)  # [n, C], [n, R]
        q_lat = torch.matmul(q_nope[start:end].to(compute).transpose(0, 1), uk)  # [H, Tq, C]
        scores = torch.matmul(q_lat, c.t())  # [H, Tq, n]
        if rope:
            scores = scores + torch.matmul(q_rot[start:end].to(compute).transpose(0, 1), k_rope.t())
        scores = (scores * scale).masked_fill(~keep[:, chosen][None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(torch.matmul(probs, c), uv.transpose(1, 2)).transpose(0, 1).to(out.dtype)
    return out

"""Paged attention in plain torch: the CPU path and the tests' float64 reference.

It computes exactly what deployments/model_rank/layers/attention.py computes (same dtypes, same order), so
the layers can call kernels.dispatch on every device without changing a CPU result: float32 models score
in float64 (batch-invariant on CPU), bf16/fp16 run QK^T and PV in their own dtype with a float32 softmax.
"""

import math

import torch


def gather_cache(cache: torch.Tensor, block_table: list[int], length: int) -> torch.Tensor:
    """The first `length` cached rows of one sequence, in order: cache [blocks, bs, ...] -> [length, ...]."""
    block_size = cache.shape[1]
    num_blocks = math.ceil(length / block_size)
    if num_blocks > len(block_table):
        raise ValueError(f"context of {length} tokens needs {num_blocks} blocks, block table has {len(block_table)}")
    index = torch.tensor(block_table[:num_blocks], dtype=torch.long, device=cache.device)
    rows = cache.index_select(0, index)  # [n, block_size, ...]
    return rows.reshape(num_blocks * block_size, *cache.shape[2:])[:length]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """One sequence's new queries over its whole context.

    q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv] -> [Tq, Hq, Dv]; query j sits at position Tk - Tq + j and,
    with `window` > 0, sees only the keys of the last `window` positions up to its own.
    """
    num_q, num_heads = q.shape[0], q.shape[1]
    num_k, group = k.shape[0], num_heads // k.shape[1]
    # float64 keeps a row's result independent of how many queries and keys share the call (float32
    # kernels here change bits with the row count), and this CPU's bf16/fp16 matmuls are ~30x slower anyway.
    compute = torch.float64 if q.device.type == "cpu" or q.dtype == torch.float32 else q.dtype
    qh = q.to(compute).transpose(0, 1)  # [Hq, Tq, D]
    kh = k.to(compute).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Tk, D]
    vh = v.to(compute).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Tk, Dv]
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scale  # [Hq, Tq, Tk]
    hidden = torch.ones(num_q, num_k, dtype=torch.bool, device=q.device).triu(num_k - num_q + 1)  # [Tq, Tk]
    if window > 0:  # and keys at or before position - window
        hidden |= torch.ones(num_q, num_k, dtype=torch.bool, device=q.device).tril(num_k - num_q - window)
    scores = scores.masked_fill(hidden, float("-inf"))
    softmax_dtype = torch.float64 if compute == torch.float64 else torch.float32
    probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(compute)  # [Hq, Tq, Tk]
    out = torch.matmul(probs, vh)  # [Hq, Tq, Dv]
    return out.transpose(0, 1).to(q.dtype)


def sequence_spans(query_lens: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each sequence's new tokens in the flat token dimension."""
    spans, start = [], 0
    for n in query_lens:
        spans.append((start, start + n))
        start += n
    return spans


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Each sequence's new queries over its cached context (`window`: as causal_attention's): q [T, Hq, D] ->
    [T, Hq, Dv]."""
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[3])  # [T, Hq, Dv]
    for (start, end), length, table in zip(sequence_spans(query_lens), context_lens, block_tables):
        if end == start:
            continue
        # Keys before the first query's window are never read: their blocks may hold anything.
        first = max(0, length - (end - start) - window + 1) if window > 0 else 0
        keys = gather_cache(k_cache, table, length)[first:]  # [ctx, Hkv, D]
        values = gather_cache(v_cache, table, length)[first:]  # [ctx, Hkv, Dv]
        out[start:end] = causal_attention(q[start:end], keys, values, scale, window)
    return out

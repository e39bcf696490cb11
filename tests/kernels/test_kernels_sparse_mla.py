"""Sparse MLA (kernels/sparse_mla.py): each query over its own selected tokens, absorbed, equals the layer's
expanded math over the same keys (every other key masked out), with and without a rope part; a query's
result is the same alone and beside other queries whose selections differ."""

import pytest
import torch

from kernels.sparse_mla import sparse_mla_torch
from kernels.testing import case_generator, paged_cache, paged_tables, randn


def _case(rope: int, query_lens: list[int], context_lens: list[int]):
    heads, latent, nope, v_dim, block_size = 3, 32, 16, 24, 8
    gen = case_generator(rope, query_lens, context_lens)
    tables, blocks = paged_tables(context_lens, block_size, gen)
    cache = paged_cache((latent + rope + 5,), tables, context_lens, blocks, block_size, torch.float32, "cpu", gen)
    tokens = sum(query_lens)
    q_nope = randn(tokens, heads, nope, dtype=torch.float32, device="cpu", gen=gen)
    q_rot = randn(tokens, heads, rope, dtype=torch.float32, device="cpu", gen=gen)
    kv_b = randn(heads, nope + v_dim, latent, dtype=torch.float32, device="cpu", gen=gen, scale=latent**-0.5)
    keeps = []
    for count, length in zip(query_lens, context_lens):
        positions = torch.arange(length - count, length)
        causal = torch.arange(length)[None, :] <= positions[:, None]
        keeps.append(
            causal & (torch.rand(count, length, generator=gen) < 0.4) | (torch.arange(length) == positions[:, None])
        )
    return q_nope, q_rot, cache, tables, kv_b.split([nope, v_dim], dim=1), keeps


def _expanded(q_nope, q_rot, cache, table, length, uk, uv, keep, scale):
    """One sequence the layer's way in float64: expand every cached latent to per-head K and V, mask."""
    latent, rope = uk.shape[2], q_rot.shape[2]
    rows = torch.stack([cache[table[p // cache.shape[1]], p % cache.shape[1]] for p in range(length)]).double()
    c, k_rope = rows[:, :latent], rows[:, latent : latent + rope]
    keys = torch.einsum("hdc,nc->nhd", uk.double(), c)
    values = torch.einsum("hvc,nc->nhv", uv.double(), c)
    scores = torch.einsum("thd,nhd->htn", q_nope.double(), keys) + torch.einsum("thr,nr->htn", q_rot.double(), k_rope)
    probs = torch.softmax((scores * scale).masked_fill(~keep[None], float("-inf")), dim=-1)
    return torch.einsum("htn,nhv->thv", probs, values).float()


@pytest.mark.parametrize("rope", [0, 8])
def test_sparse_mla_equals_expanded_attention_over_the_selection(rope: int) -> None:
    query_lens, context_lens = [1, 5, 3], [40, 23, 3]
    q_nope, q_rot, cache, tables, (uk, uv), keeps = _case(rope, query_lens, context_lens)
    out = sparse_mla_torch(q_nope, q_rot, cache, query_lens, context_lens, tables, 0.2, uk, uv, keeps)
    start = 0
    for count, length, table, keep in zip(query_lens, context_lens, tables, keeps):
        span = slice(start, start + count)
        expected = _expanded(q_nope[span], q_rot[span], cache, table, length, uk, uv, keep, 0.2)
        torch.testing.assert_close(out[span], expected, rtol=1e-5, atol=1e-5)
        start += count


def test_a_query_alone_equals_itself_among_others() -> None:
    query_lens, context_lens = [5], [23]
    q_nope, q_rot, cache, tables, (uk, uv), keeps = _case(8, query_lens, context_lens)
    together = sparse_mla_torch(q_nope, q_rot, cache, query_lens, context_lens, tables, 0.2, uk, uv, keeps)
    for row in range(5):
        alone_keep = [keeps[0][row : row + 1]]
        q = (q_nope[row : row + 1], q_rot[row : row + 1])
        alone = sparse_mla_torch(*q, cache, [1], context_lens, tables, 0.2, uk, uv, alone_keep)
        assert torch.equal(alone[0], together[row])

"""Paged decode and prefill attention kernels against the float64 torch path (Triton interpreter on CPU).

Caches hold NaN outside every context, outputs start as NaN, and tiny splits (32 keys, tiles of 16) make
short contexts cross several splits, so masking, split-K and merging are all exercised. Sliding-window
cases also hold NaN below every query's window, as if those blocks had been freed and reused.
"""

import pytest
import torch

from kernels.testing import assert_close, case_generator, kernel_test_device, paged_cache, paged_tables, poisoned, randn

DEVICE = kernel_test_device()  # turns the interpreter on before Triton is imported
pytest.importorskip(
    "triton", reason="Triton is not importable: kernel tests need it (pip install triton)", exc_type=ImportError
)

from kernels.attention_torch import gather_cache, paged_attention_torch  # noqa: E402
from kernels.paged_decode_attention import paged_decode_attention  # noqa: E402
from kernels.paged_meta import build_paged_meta  # noqa: E402
from kernels.paged_prefill_attention import paged_prefill_attention  # noqa: E402

SPLIT, TILE = 32, 16  # small, so contexts of tens of tokens span several splits


def make_inputs(dtype, q_heads, kv_heads, head_dim, block_size, query_lens, context_lens, v_dim=None):
    gen = case_generator(dtype, q_heads, kv_heads, head_dim, block_size, query_lens, context_lens)
    tables, num_blocks = paged_tables(context_lens, block_size, gen)
    k_cache = paged_cache((kv_heads, head_dim), tables, context_lens, num_blocks, block_size, dtype, DEVICE, gen)
    v_cache = paged_cache(
        (kv_heads, v_dim or head_dim), tables, context_lens, num_blocks, block_size, dtype, DEVICE, gen
    )
    q = randn(sum(query_lens), q_heads, head_dim, dtype=dtype, device=DEVICE, gen=gen)
    return q, k_cache, v_cache, tables


def reference(q, k_cache, v_cache, query_lens, context_lens, tables):
    scale = q.shape[2] ** -0.5
    return paged_attention_torch(
        q.double(), k_cache.double(), v_cache.double(), query_lens, context_lens, tables, scale
    )


def run_decode(q, k_cache, v_cache, query_lens, context_lens, tables, **tiling):
    meta = build_paged_meta(query_lens, context_lens, tables, k_cache.shape[1], DEVICE)
    out = poisoned(q.shape[0], q.shape[1], v_cache.shape[3], dtype=q.dtype, device=DEVICE)
    paged_decode_attention(q, k_cache, v_cache, meta, q.shape[2] ** -0.5, out, **tiling)
    return out


def run_prefill(q, k_cache, v_cache, query_lens, context_lens, tables, block_m=16, window=0):
    meta = build_paged_meta(query_lens, context_lens, tables, k_cache.shape[1], DEVICE, row_query_limit=0)
    out = poisoned(q.shape[0], q.shape[1], v_cache.shape[3], dtype=q.dtype, device=DEVICE)
    paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        meta,
        q.shape[2] ** -0.5,
        out,
        kv_split=SPLIT,
        block_n=TILE,
        block_m=block_m,
        window=window,
    )
    return out


def windowed_reference(q, k_cache, v_cache, query_lens, context_lens, tables, window):
    """float64 attention in which a query at position p sees keys p - window < j <= p (window 0: all j <= p)."""
    scale = q.shape[2] ** -0.5
    out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[3], dtype=torch.float64)
    start = 0
    for new, length, table in zip(query_lens, context_lens, tables):
        group = q.shape[1] // k_cache.shape[2]
        k = gather_cache(k_cache.double().cpu(), table, length).repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = gather_cache(v_cache.double().cpu(), table, length).repeat_interleave(group, dim=1)  # [ctx, Hq, Dv]
        pos = torch.arange(length - new, length)[:, None]  # [new, 1]
        key = torch.arange(length)[None, :]  # [1, ctx]
        hidden = (key > pos) | ((key <= pos - window) if window > 0 else torch.zeros_like(key, dtype=torch.bool))
        scores = torch.einsum("thd,khd->htk", q[start : start + new].double().cpu(), k) * scale
        probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        out[start : start + new] = torch.einsum("htk,khd->thd", probs, v)
        start += new
    return out


def poison_below_windows(caches, query_lens, context_lens, tables, window):
    """NaN in every slot below each sequence's first query's window: nothing there may be read."""
    for cache in caches:
        block_size = cache.shape[1]
        for new, length, table in zip(query_lens, context_lens, tables):
            for pos in range(max(0, length - new + 1 - window)):
                cache[table[pos // block_size], pos % block_size] = float("nan")


@pytest.mark.parametrize(
    "dtype, q_heads, kv_heads, head_dim, block_size, context_lens",
    [
        (torch.float32, 2, 2, 64, 16, [1, 17, 70]),  # GQA 1, one-token context, ragged
        (torch.bfloat16, 8, 2, 128, 5, [3, 33, 64]),  # GQA 4, block size not a power of two
        (torch.float32, 8, 1, 64, 16, [16, 71]),  # GQA 8, exact block and split boundaries
        (torch.bfloat16, 8, 1, 64, 16, [40]),  # GQA 8 in bf16
        (torch.float16, 4, 1, 64, 8, [9, 2]),
    ],
)
def test_decode_matches_reference(dtype, q_heads, kv_heads, head_dim, block_size, context_lens):
    query_lens = [1] * len(context_lens)
    q, k_cache, v_cache, tables = make_inputs(dtype, q_heads, kv_heads, head_dim, block_size, query_lens, context_lens)
    out = run_decode(q, k_cache, v_cache, query_lens, context_lens, tables, kv_split=SPLIT, block_n=TILE)
    assert_close(out, reference(q, k_cache, v_cache, query_lens, context_lens, tables), dtype)


def test_decode_default_tiling_and_v_dim():
    """Production split/tile sizes, and a V head size unlike K's."""
    query_lens, context_lens = [1, 1], [5, 77]
    q, k_cache, v_cache, tables = make_inputs(torch.float32, 4, 2, 64, 16, query_lens, context_lens, v_dim=32)
    out = run_decode(q, k_cache, v_cache, query_lens, context_lens, tables)
    assert_close(out, reference(q, k_cache, v_cache, query_lens, context_lens, tables), torch.float32)


def test_decode_rows_of_a_short_query():
    """Drafted tokens (several new tokens per sequence) run as rows, each with its own causal length."""
    query_lens, context_lens = [3, 1], [20, 9]
    q, k_cache, v_cache, tables = make_inputs(torch.float32, 4, 2, 64, 8, query_lens, context_lens)
    out = run_decode(q, k_cache, v_cache, query_lens, context_lens, tables, kv_split=SPLIT, block_n=TILE)
    assert_close(out, reference(q, k_cache, v_cache, query_lens, context_lens, tables), torch.float32)


def test_decode_row_is_batch_invariant():
    """A row's bits do not depend on the other rows (their count or lengths)."""
    query_lens, context_lens = [1, 1, 1], [70, 5, 33]
    q, k_cache, v_cache, tables = make_inputs(torch.bfloat16, 4, 2, 64, 16, query_lens, context_lens)
    together = run_decode(q, k_cache, v_cache, query_lens, context_lens, tables, kv_split=SPLIT, block_n=TILE)
    for i in range(3):
        alone = run_decode(
            q[i : i + 1], k_cache, v_cache, [1], [context_lens[i]], [tables[i]], kv_split=SPLIT, block_n=TILE
        )
        assert torch.equal(alone[0], together[i])


@pytest.mark.parametrize(
    "dtype, q_heads, kv_heads, head_dim, block_size, cached, new",
    [
        (torch.float32, 2, 2, 64, 16, [0, 17, 13], [5, 1, 20]),  # no prefix, one token, prefix + chunk
        (torch.bfloat16, 4, 1, 128, 5, [40, 0], [3, 33]),  # GQA 4, head dim 128
        (torch.float32, 8, 1, 64, 16, [3], [17]),  # GQA 8
    ],
)
def test_prefill_matches_reference(dtype, q_heads, kv_heads, head_dim, block_size, cached, new):
    context_lens = [c + n for c, n in zip(cached, new)]
    q, k_cache, v_cache, tables = make_inputs(dtype, q_heads, kv_heads, head_dim, block_size, new, context_lens)
    out = run_prefill(q, k_cache, v_cache, new, context_lens, tables)
    assert_close(out, reference(q, k_cache, v_cache, new, context_lens, tables), dtype)


def test_prefill_rows_match_chunked_prefill_and_decode():
    """A token's bits are the same whether its prefill ran whole, in chunks, or it ran as a decode row
    (same split and tile tree; on the interpreter the dot does not depend on the tile's row count)."""
    context = 45
    q, k_cache, v_cache, tables = make_inputs(torch.float32, 2, 1, 64, 16, [context], [context])
    whole = run_prefill(q, k_cache, v_cache, [context], [context], tables)
    first = run_prefill(q[:19], k_cache, v_cache, [19], [19], tables)
    rest = run_prefill(q[19:], k_cache, v_cache, [context - 19], [context], tables)
    assert torch.equal(torch.cat([first, rest]), whole)
    rows = run_decode(q[40:], k_cache, v_cache, [5], [context], tables, kv_split=SPLIT, block_n=TILE)
    assert torch.equal(rows, whole[40:])


@pytest.mark.parametrize(
    "dtype, q_heads, kv_heads, head_dim, block_size, context_lens, window",
    [
        (torch.float32, 2, 2, 64, 16, [70, 17, 5], 20),  # smaller than some contexts, larger than others
        (torch.float32, 4, 2, 64, 16, [40], 40),  # equal to the context
        (torch.float32, 2, 1, 64, 8, [70, 3], 100),  # larger than every context
        (torch.bfloat16, 8, 2, 64, 5, [1, 33, 70], 1),  # only the query's own key
        (torch.float32, 4, 1, 64, 16, [150, 97], 45),  # from key 105 (mid split, tile and block) of 150
        (torch.bfloat16, 4, 2, 128, 7, [129, 64], 32),  # one whole split, or a split boundary inside
    ],
)
def test_decode_window_matches_reference(dtype, q_heads, kv_heads, head_dim, block_size, context_lens, window):
    query_lens = [1] * len(context_lens)
    q, k_cache, v_cache, tables = make_inputs(dtype, q_heads, kv_heads, head_dim, block_size, query_lens, context_lens)
    ref = windowed_reference(q, k_cache, v_cache, query_lens, context_lens, tables, window)
    poison_below_windows((k_cache, v_cache), query_lens, context_lens, tables, window)
    out = run_decode(q, k_cache, v_cache, query_lens, context_lens, tables, kv_split=SPLIT, block_n=TILE, window=window)
    assert_close(out, ref, dtype)


def test_decode_window_default_tiling_and_drafted_rows():
    """Production split/tile sizes with a window inside the second split, and drafted tokens as rows."""
    query_lens, context_lens, window = [3, 1], [300, 20], 70
    q, k_cache, v_cache, tables = make_inputs(torch.float32, 4, 2, 64, 16, query_lens, context_lens, v_dim=32)
    ref = windowed_reference(q, k_cache, v_cache, query_lens, context_lens, tables, window)
    poison_below_windows((k_cache, v_cache), query_lens, context_lens, tables, window)
    out = run_decode(q, k_cache, v_cache, query_lens, context_lens, tables, window=window)
    assert_close(out, ref, torch.float32)


def test_window_zero_is_full_attention():
    query_lens, context_lens = [1, 1], [70, 9]
    q, k_cache, v_cache, tables = make_inputs(torch.bfloat16, 4, 2, 64, 16, query_lens, context_lens)
    tiling = dict(kv_split=SPLIT, block_n=TILE)
    full = run_decode(q, k_cache, v_cache, query_lens, context_lens, tables, **tiling)
    assert torch.equal(run_decode(q, k_cache, v_cache, query_lens, context_lens, tables, window=0, **tiling), full)
    assert_close(full, windowed_reference(q, k_cache, v_cache, query_lens, context_lens, tables, 0), torch.bfloat16)


def test_decode_window_row_is_batch_invariant():
    """With a window too, a row's bits do not depend on the other rows."""
    query_lens, context_lens, window = [1, 1, 1], [70, 5, 133], 21
    q, k_cache, v_cache, tables = make_inputs(torch.bfloat16, 4, 2, 64, 16, query_lens, context_lens)
    tiling = dict(kv_split=SPLIT, block_n=TILE, window=window)
    together = run_decode(q, k_cache, v_cache, query_lens, context_lens, tables, **tiling)
    for i in range(3):
        alone = run_decode(q[i : i + 1], k_cache, v_cache, [1], [context_lens[i]], [tables[i]], **tiling)
        assert torch.equal(alone[0], together[i])


@pytest.mark.parametrize(
    "dtype, q_heads, kv_heads, head_dim, block_size, cached, new, window",
    [
        (torch.float32, 2, 2, 64, 16, [0, 17, 13], [5, 1, 20], 7),  # smaller than most contexts
        (torch.float32, 2, 1, 64, 16, [0, 10], [40, 30], 40),  # equal to the longest context
        (torch.float32, 4, 2, 64, 8, [3, 0], [17, 20], 64),  # larger than every context
        (torch.bfloat16, 4, 1, 128, 5, [40, 0], [3, 33], 1),  # only the token's own key
        (torch.float32, 4, 1, 64, 16, [100], [40], 45),  # first token from key 56: mid split, tile and block
        (torch.bfloat16, 8, 2, 64, 7, [70], [50], 33),  # blocks of tokens with windows across splits
    ],
)
def test_prefill_window_matches_reference(dtype, q_heads, kv_heads, head_dim, block_size, cached, new, window):
    context_lens = [c + n for c, n in zip(cached, new)]
    q, k_cache, v_cache, tables = make_inputs(dtype, q_heads, kv_heads, head_dim, block_size, new, context_lens)
    ref = windowed_reference(q, k_cache, v_cache, new, context_lens, tables, window)
    poison_below_windows((k_cache, v_cache), new, context_lens, tables, window)
    out = run_prefill(q, k_cache, v_cache, new, context_lens, tables, window=window)
    assert_close(out, ref, dtype)


def test_window_rows_match_chunked_prefill_and_decode():
    """With a window, a token's bits are still the same whole, chunked, or as a decode row."""
    context, window = 110, 37
    q, k_cache, v_cache, tables = make_inputs(torch.float32, 2, 1, 64, 16, [context], [context])
    whole = run_prefill(q, k_cache, v_cache, [context], [context], tables, window=window)
    first = run_prefill(q[:19], k_cache, v_cache, [19], [19], tables, window=window)
    middle = run_prefill(q[19:70], k_cache, v_cache, [51], [70], tables, window=window)
    rest = run_prefill(q[70:], k_cache, v_cache, [context - 70], [context], tables, window=window)
    assert torch.equal(torch.cat([first, middle, rest]), whole)
    tiling = dict(kv_split=SPLIT, block_n=TILE, window=window)
    rows = run_decode(q[context - 6 :], k_cache, v_cache, [6], [context], tables, **tiling)
    assert torch.equal(rows, whole[context - 6 :])
    row = run_decode(q[60:61], k_cache, v_cache, [1], [61], tables, **tiling)
    assert torch.equal(row[0], whole[60])


def test_wrapper_rejects_bad_arguments():
    q, k_cache, v_cache, tables = make_inputs(torch.float32, 4, 2, 64, 16, [1], [5])
    meta = build_paged_meta([1], [5], tables, 16, DEVICE)
    out = poisoned(1, 4, 64, dtype=torch.float32, device=DEVICE)
    with pytest.raises(TypeError, match="share one dtype"):
        paged_decode_attention(q.bfloat16(), k_cache, v_cache, meta, 0.1, out)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(q[..., :32], k_cache, v_cache, meta, 0.1, out)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode_attention(q[:, :3], k_cache, v_cache, meta, 0.1, out[:, :3])
    with pytest.raises(ValueError, match="block_n"):
        paged_decode_attention(q, k_cache, v_cache, meta, 0.1, out, kv_split=40, block_n=16)
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention(q, k_cache, v_cache, meta, 0.1, out, window=-1)
    with pytest.raises(ValueError, match="window"):
        paged_prefill_attention(q, k_cache, v_cache, meta, 0.1, out, window=-1)
    with pytest.raises(ValueError, match="needs 2 blocks"):
        build_paged_meta([1], [17], [[0]], 16, DEVICE)

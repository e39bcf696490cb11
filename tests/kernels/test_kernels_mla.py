"""MLA attention over the latent cache (absorbed projections) against the layer's expanded math in float64."""

import pytest
import torch

from kernels.testing import assert_close, case_generator, kernel_test_device, paged_cache, paged_tables, poisoned, randn

DEVICE = kernel_test_device()  # turns the interpreter on before Triton is imported
pytest.importorskip(
    "triton", reason="Triton is not importable: kernel tests need it (pip install triton)", exc_type=ImportError
)

from kernels.mla_decode import default_kv_b, mla_attention_torch, mla_attention_triton, mla_decode_attention  # noqa: E402
from kernels.paged_meta import build_paged_meta  # noqa: E402

ALL_ROWS = 2**31 - 1  # MLA runs every token as a row


def make_inputs(dtype, heads, latent, rope, nope, v_dim, block_size, query_lens, context_lens):
    gen = case_generator(dtype, heads, latent, rope, nope, v_dim, block_size, query_lens, context_lens)
    tables, num_blocks = paged_tables(context_lens, block_size, gen)
    cache = paged_cache((latent + rope,), tables, context_lens, num_blocks, block_size, dtype, DEVICE, gen)
    tokens = sum(query_lens)
    q_nope = randn(tokens, heads, nope, dtype=dtype, device=DEVICE, gen=gen)
    q_rot = randn(tokens, heads, rope, dtype=dtype, device=DEVICE, gen=gen)
    kv_b_weight = randn(heads * (nope + v_dim), latent, dtype=dtype, device=DEVICE, gen=gen, scale=latent**-0.5)
    return q_nope, q_rot, cache, kv_b_weight, tables


@pytest.mark.parametrize(
    "dtype, heads, latent, rope, nope, v_dim, block_size, query_lens, context_lens",
    [
        (torch.float32, 4, 64, 16, 32, 32, 16, [1, 1, 3], [1, 40, 70]),  # decode, one-token context, drafts
        (torch.bfloat16, 20, 64, 16, 48, 64, 5, [1, 2], [33, 70]),  # 20 heads: two head blocks, one partial
        (torch.float32, 2, 32, 8, 16, 24, 8, [6], [6]),  # a short prefill (rows with their own lengths)
    ],
)
def test_mla_matches_expanded_reference(dtype, heads, latent, rope, nope, v_dim, block_size, query_lens, context_lens):
    q_nope, q_rot, cache, w, tables = make_inputs(
        dtype, heads, latent, rope, nope, v_dim, block_size, query_lens, context_lens
    )
    meta = build_paged_meta(query_lens, context_lens, tables, block_size, DEVICE, ALL_ROWS)
    scale = (nope + rope) ** -0.5
    out_lat = poisoned(sum(query_lens), heads, latent, dtype=dtype, device=DEVICE)
    out = mla_attention_triton(q_nope, q_rot, cache, meta, scale, w, v_dim, kv_split=32, block_n=16, out_lat=out_lat)
    assert torch.isfinite(out_lat).all()
    ref = mla_attention_torch(
        q_nope.double(),
        q_rot.double(),
        cache.double(),
        query_lens,
        context_lens,
        tables,
        scale,
        default_kv_b(w.double()),
        v_dim,
    )
    assert_close(out, ref, dtype)


def test_latent_kernel_writes_every_row_and_keeps_rows_apart():
    """The latent kernel alone: every element written, and a row's bits independent of the other rows."""
    query_lens, context_lens = [1, 1], [50, 7]
    q_nope, q_rot, cache, w, tables = make_inputs(torch.float32, 4, 64, 16, 32, 32, 16, query_lens, context_lens)
    q_lat = randn(2, 4, 64, dtype=torch.float32, device=DEVICE, gen=case_generator("q_lat"))
    meta = build_paged_meta(query_lens, context_lens, tables, 16, DEVICE, ALL_ROWS)
    out = poisoned(2, 4, 64, dtype=torch.float32, device=DEVICE)
    mla_decode_attention(q_lat, q_rot, cache, meta, 0.1, out, kv_split=32, block_n=16)
    assert torch.isfinite(out).all()
    alone = poisoned(1, 4, 64, dtype=torch.float32, device=DEVICE)
    meta1 = build_paged_meta([1], [50], [tables[0]], 16, DEVICE, ALL_ROWS)
    mla_decode_attention(q_lat[:1], q_rot[:1], cache, meta1, 0.1, alone, kv_split=32, block_n=16)
    assert torch.equal(alone[0], out[0])


def test_mla_rejects_mismatched_cache():
    q_nope, q_rot, cache, w, tables = make_inputs(torch.float32, 2, 32, 8, 16, 16, 8, [1], [3])
    meta = build_paged_meta([1], [3], tables, 8, DEVICE, ALL_ROWS)
    with pytest.raises(ValueError, match="latent \\+ rope"):
        mla_attention_triton(q_nope, q_rot[..., :4], cache, meta, 0.1, w, 16)
    with pytest.raises(ValueError, match="every token as a row"):
        mla_attention_triton(q_nope, q_rot, cache, build_paged_meta([1], [3], tables, 8, DEVICE, 0), 0.1, w, 16)

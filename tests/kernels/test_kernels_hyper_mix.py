"""Hyper-connections (kernels/hyper_mix.py): the native weights equal the torch reference within float32
rounding, each token's bits are the same alone or among others, the Sinkhorn result's columns sum to one
and its rows nearly, and more streams than the native kernel holds run the reference; the native collapse
and merge give the reference's bits in every dtype."""

import pytest
import torch

from kernels import cpu_native, dispatch, hyper_mix

NATIVE = pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels are off")


def _case(tokens: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    width = (2 + n) * n
    mix = torch.randn(tokens, width, generator=gen) * 2
    return mix, torch.randn(width, generator=gen) * 0.3, torch.rand(3, generator=gen) + 0.5


@NATIVE
@pytest.mark.parametrize("n", [1, 4, 7])
def test_native_weights_equal_the_reference(n: int) -> None:
    mix, base, scale = _case(70, n)
    native = hyper_mix.hyper_weights_native(mix, base, scale, n, 20, 1e-6)
    reference = hyper_mix.hyper_weights_torch(mix, base, scale, n, 20, 1e-6)
    for ours, theirs in zip(native, reference):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    comb = native[2]
    torch.testing.assert_close(comb.sum(dim=1), torch.ones(70, n), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(comb.sum(dim=2), torch.ones(70, n), rtol=0.05, atol=0.05)  # 20 rounds: near


@NATIVE
def test_a_token_alone_equals_itself_among_others() -> None:
    mix, base, scale = _case(70, 4)
    together = dispatch.hyper_weights(mix, base, scale, 4, 20, 1e-6)
    for row in (0, 33, 69):
        alone = dispatch.hyper_weights(mix[row : row + 1].contiguous(), base, scale, 4, 20, 1e-6)
        assert all(torch.equal(a[0], t[row]) for a, t in zip(alone, together))


def test_more_streams_than_the_native_kernel_holds_run_the_reference() -> None:
    mix, base, scale = _case(3, 17)
    assert not hyper_mix.native_supported(mix, base, scale, 17)
    out = dispatch.hyper_weights(mix, base, scale, 17, 3, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(out, hyper_mix.hyper_weights_torch(mix, base, scale, 17, 3, 1e-6)))


@NATIVE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_collapse_and_merge_give_the_reference_bits(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    tokens, n, hidden = 37, 4, 100  # a hidden size past whole 16-lane chunks
    streams = torch.randn(tokens, n, hidden, generator=gen).to(dtype)
    block = torch.randn(tokens, hidden, generator=gen).to(dtype)
    pre, post = torch.rand(tokens, n, generator=gen), 2 * torch.rand(tokens, n, generator=gen)
    comb = torch.rand(tokens, n, n, generator=gen)
    assert torch.equal(hyper_mix.collapse_native(streams, pre), hyper_mix.collapse_torch(streams, pre))
    merged = hyper_mix.merge_native(streams, block, post, comb)
    assert torch.equal(merged, hyper_mix.merge_torch(streams, block, post, comb))
    row = slice(5, 6)
    alone = hyper_mix.merge_native(streams[row].clone(), block[row].clone(), post[row].clone(), comb[row].clone())
    assert torch.equal(alone, merged[row])

"""GLM sigmoid routing and the fused grouped-GEMM experts against float64 torch."""

import pytest
import torch

from kernels.testing import assert_close, case_generator, kernel_test_device, poisoned, randn

DEVICE = kernel_test_device()  # turns the interpreter on before Triton is imported
pytest.importorskip(
    "triton", reason="Triton is not importable: kernel tests need it (pip install triton)", exc_type=ImportError
)

from kernels.activation import gelu_tanh  # noqa: E402
from kernels.fused_moe import fused_moe, fused_moe_torch, relu2_moe_torch, sort_by_expert  # noqa: E402
from kernels.moe_routing import grouped_topk, grouped_topk_torch  # noqa: E402


@pytest.mark.parametrize(
    "tokens, experts, top_k, n_group, topk_group, normalize",
    [
        (7, 64, 8, 1, 1, True),  # GLM-4.x shape: one group
        (5, 32, 4, 4, 2, True),  # DeepSeek-style groups
        (1, 24, 6, 8, 3, False),  # one token, groups of 3 (padded lanes), no normalisation
    ],
)
def test_grouped_topk(tokens, experts, top_k, n_group, topk_group, normalize):
    gen = case_generator("route", tokens, experts, top_k, n_group, topk_group)
    logits = randn(tokens, experts, dtype=torch.float32, device=DEVICE, gen=gen, scale=2.0)
    bias = randn(experts, dtype=torch.float32, device=DEVICE, gen=gen, scale=0.1)
    weights, ids = (
        poisoned(tokens, top_k, dtype=torch.float32, device=DEVICE),
        torch.full((tokens, top_k), -1, device=DEVICE),
    )
    grouped_topk(logits, bias, top_k, n_group, topk_group, normalize, 2.5, weights, ids)
    ref_w, ref_ids = grouped_topk_torch(logits.double(), bias.double(), top_k, n_group, topk_group, normalize, 2.5)
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    assert_close(weights, ref_w, torch.float32)


def test_sort_by_expert_pads_each_run():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEVICE)
    pairs, block_expert = sort_by_expert(ids, num_experts=4, block_m=4)
    assert block_expert.tolist()[:3] == [0, 1, 2] and all(e == 4 for e in block_expert.tolist()[3:])
    # pair p = token * k + slot; expert 0 holds pairs 1 and 4, expert 1 pair 3, expert 2 pairs 0, 2, 5
    assert pairs.tolist()[:12] == [1, 4, 6, 6, 3, 6, 6, 6, 0, 2, 5, 6]  # 6 = padding (number of pairs)


def expert_weights(dtype, experts, hidden, inter, gen):
    gate = randn(experts, inter, hidden, dtype=dtype, device=DEVICE, gen=gen, scale=hidden**-0.5)
    up = randn(experts, inter, hidden, dtype=dtype, device=DEVICE, gen=gen, scale=hidden**-0.5)
    down = randn(experts, hidden, inter, dtype=dtype, device=DEVICE, gen=gen, scale=inter**-0.5)
    return gate, up, down


def routing(tokens, experts, top_k, gen):
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(DEVICE)
    return torch.rand(tokens, top_k, generator=gen).to(DEVICE) + 0.1, ids


@pytest.mark.parametrize(
    "dtype, tokens, experts, top_k, hidden, inter",
    [
        (torch.float32, 5, 8, 2, 64, 96),  # intermediate not a multiple of the 64-wide tile
        (torch.bfloat16, 6, 8, 4, 128, 64),
        (torch.float32, 1, 16, 4, 64, 32),  # one token (decode)
    ],
)
def test_fused_moe(dtype, tokens, experts, top_k, hidden, inter):
    gen = case_generator("moe", dtype, tokens, experts, top_k, hidden, inter)
    x = randn(tokens, hidden, dtype=dtype, device=DEVICE, gen=gen)
    gate, up, down = expert_weights(dtype, experts, hidden, inter, gen)
    weights, ids = routing(tokens, experts, top_k, gen)
    out = fused_moe(x, weights, ids, gate, up, down, out=poisoned(tokens, hidden, dtype=dtype, device=DEVICE))
    ref = fused_moe_torch(x.double(), weights.double(), ids, gate.double(), up.double(), down.double())
    assert_close(out, ref, dtype)


def test_fused_moe_token_is_batch_invariant():
    gen = case_generator("moe invariance")
    x = randn(5, 64, dtype=torch.bfloat16, device=DEVICE, gen=gen)
    gate, up, down = expert_weights(torch.bfloat16, 8, 64, 32, gen)
    weights, ids = routing(5, 8, 2, gen)
    together = fused_moe(x, weights, ids, gate, up, down)
    alone = fused_moe(x[3:4], weights[3:4], ids[3:4], gate, up, down)
    assert torch.equal(alone[0], together[3])


@pytest.mark.parametrize("dtype, tokens", [(torch.float32, 5), (torch.bfloat16, 6), (torch.float32, 1)])
def test_fused_relu_squared_experts_without_a_gate(dtype, tokens):
    """Nemotron-H's experts (gate_proj None): the Triton path against the CPU path's per-expert loop."""
    gen = case_generator("relu2 moe", dtype, tokens)
    x = randn(tokens, 64, dtype=dtype, device=DEVICE, gen=gen)
    _, up, down = expert_weights(dtype, 8, 64, 96, gen)
    weights, ids = routing(tokens, 8, 2, gen)
    out = fused_moe(x, weights, ids, None, up, down, out=poisoned(tokens, 64, dtype=dtype, device=DEVICE))
    ref = relu2_moe_torch(x.double(), weights.double(), ids, up.double(), down.double(), torch.nn.functional.linear)
    assert_close(out, ref, dtype)
    alone = fused_moe(x[-1:], weights[-1:], ids[-1:], None, up, down)
    assert torch.equal(alone[0], out[-1])  # a token's result does not depend on the others


@pytest.mark.parametrize("dtype, tokens", [(torch.float32, 5), (torch.bfloat16, 6), (torch.float32, 1)])
def test_fused_gelu_tanh_experts(dtype, tokens):
    """Gemma 4's experts (GELU-tanh gates): the Triton path against the CPU path's loop in float64, whose
    composed GELU is torch's own to 1e-12, and a token's result alone equals its result among the others."""
    gen = case_generator("gelu moe", dtype, tokens)
    x = randn(tokens, 64, dtype=dtype, device=DEVICE, gen=gen)
    gate, up, down = expert_weights(dtype, 8, 64, 96, gen)
    weights, ids = routing(tokens, 8, 2, gen)
    poison = poisoned(tokens, 64, dtype=dtype, device=DEVICE)
    out = fused_moe(x, weights, ids, gate, up, down, out=poison, activation="gelu_tanh")
    wide = x.double(), weights.double(), gate.double(), up.double(), down.double()
    ref = fused_moe_torch(wide[0], wide[1], ids, *wide[2:], activation="gelu_tanh")
    assert_close(out, ref, dtype)
    rows = wide[0] @ wide[2][0].T
    assert (gelu_tanh(rows) - torch.nn.functional.gelu(rows, approximate="tanh")).abs().max() < 1e-12
    alone = fused_moe(x[-1:], weights[-1:], ids[-1:], gate, up, down, activation="gelu_tanh")
    assert torch.equal(alone[0], out[-1])


@pytest.mark.parametrize("dtype, tokens", [(torch.float32, 5), (torch.bfloat16, 6)])
def test_fused_silu_experts_with_a_swiglu_limit(dtype, tokens):
    """GLM's clamped SwiGLU: gate to max=limit, up to [-limit, limit]. The limit is small enough that both
    clamps bite; the result differs from the unclamped one, matches float64 torch, and a token alone gives
    its bits among the others."""
    gen = case_generator("swiglu limit moe", dtype, tokens)
    x = randn(tokens, 64, dtype=dtype, device=DEVICE, gen=gen)
    gate, up, down = expert_weights(dtype, 8, 64, 96, gen)
    weights, ids = routing(tokens, 8, 2, gen)
    limit = 0.5
    wide = x.double(), weights.double(), gate.double(), up.double(), down.double()
    pair_x = wide[0].repeat_interleave(ids.shape[1], dim=0)  # each routed pair's token
    gate_rows, up_rows = (torch.einsum("ph,pih->pi", pair_x, w[ids.flatten()]) for w in (wide[2], wide[3]))
    assert (gate_rows > limit).any() and (up_rows > limit).any() and (up_rows < -limit).any()
    out = fused_moe(x, weights, ids, gate, up, down, out=poisoned(tokens, 64, dtype=dtype, device=DEVICE), limit=limit)
    ref = fused_moe_torch(wide[0], wide[1], ids, *wide[2:], limit=limit)
    assert_close(out, ref, dtype)
    assert not torch.allclose(ref, fused_moe_torch(wide[0], wide[1], ids, *wide[2:]), atol=1e-3)
    alone = fused_moe(x[-1:], weights[-1:], ids[-1:], gate, up, down, limit=limit)
    assert torch.equal(alone[0], out[-1])


def test_swiglu_limit_is_refused_for_other_activations():
    gen = case_generator("swiglu limit refused")
    x = randn(2, 64, dtype=torch.float32, device=DEVICE, gen=gen)
    gate, up, down = expert_weights(torch.float32, 4, 64, 32, gen)
    weights, ids = routing(2, 4, 2, gen)
    with pytest.raises(ValueError, match="swiglu limit"):
        fused_moe(x, weights, ids, gate, up, down, activation="gelu_tanh", limit=1.0)
    with pytest.raises(ValueError, match="swiglu limit"):
        fused_moe(x, weights, ids, None, up, down, limit=1.0)
    with pytest.raises(ValueError, match="swiglu limit"):
        fused_moe_torch(x, weights, ids, gate, up, down, activation="gelu_tanh", limit=1.0)

"""kernels.dispatch: the torch path on CPU (bit for bit what the layers compute), the env override, and
the Triton route (forced on CPU under the interpreter) over a step mixing decode, drafts and prefill."""

from dataclasses import replace

import pytest
import torch

from kernels.testing import assert_close, case_generator, kernel_test_device, paged_cache, paged_tables, randn

DEVICE = kernel_test_device()  # turns the interpreter on before Triton is imported

from deployments.model_rank.forward_batch import ForwardBatch, ParallelContext  # noqa: E402
from deployments.model_rank.layers import attention as layer_attention  # noqa: E402
from deployments.model_rank.layers.linear import invariant_linear  # noqa: E402
from deployments.model_rank.layers.mla import MLAAttention, MLADims  # noqa: E402
from deployments.model_rank.layers.moe import Experts, Router, RoutingConfig  # noqa: E402
from deployments.model_rank.layers.norm import RMSNorm  # noqa: E402
from deployments.model_rank.layers.rotary import RopeConfig, RotaryEmbedding  # noqa: E402
from kernels import attention_torch, dispatch, fused_moe, matmul, mla_decode, recurrent_scan  # noqa: E402
from tests.support.sync_guard import no_host_sync  # noqa: E402

CPU = torch.device("cpu")
ON_DEVICE = ("input_ids", "positions", "slot_mapping", "logits_indices")  # ForwardBatch's tensors


def make_batch(query_lens, context_lens, block_size, gen, device=CPU):
    tables, num_blocks = paged_tables(context_lens, block_size, gen)
    positions = torch.cat([torch.arange(c - q, c) for q, c in zip(query_lens, context_lens)])
    slots = torch.tensor(
        [
            t[p // block_size] * block_size + p % block_size
            for t, q, c in zip(tables, query_lens, context_lens)
            for p in range(c - q, c)
        ]
    )
    batch = ForwardBatch(
        input_ids=torch.zeros(sum(query_lens), dtype=torch.long),
        positions=positions,
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=tables,
        slot_mapping=slots.to(device),
        logits_indices=torch.zeros(0, dtype=torch.long),
        block_size=block_size,
    )
    return batch, num_blocks


def test_backend_choice(monkeypatch):
    x = torch.ones(2)
    monkeypatch.delenv("TENSORFOLD_KERNELS", raising=False)
    assert dispatch.backend(x) == "torch"  # CPU tensors
    monkeypatch.setenv("TENSORFOLD_KERNELS", "torch")
    assert dispatch.backend(x) == "torch"
    monkeypatch.setenv("TENSORFOLD_KERNELS", "Triton")
    if dispatch.HAS_TRITON:
        assert dispatch.backend(x) == "triton"
    else:
        with pytest.raises(RuntimeError, match="not installed"):
            dispatch.backend(x)
    monkeypatch.setenv("TENSORFOLD_KERNELS", "cuda")
    with pytest.raises(ValueError, match="TENSORFOLD_KERNELS"):
        dispatch.backend(x)


@pytest.fixture
def no_triton(monkeypatch):
    """Every Triton entry point dispatch uses raises: a CPU call must not reach one."""
    monkeypatch.delenv("TENSORFOLD_KERNELS", raising=False)

    def boom(*args, **kwargs):
        raise AssertionError("dispatch took the Triton path for CPU tensors")

    for module, name in [
        (dispatch.kv_write, "write_cache"),
        (dispatch.rmsnorm, "rms_norm"),
        (dispatch.rmsnorm, "add_rms_norm"),
        (dispatch.rotary, "rotary"),
        (dispatch.moe_routing, "grouped_topk"),
        (dispatch.fused_moe, "fused_moe"),
        (dispatch.mla_decode, "mla_attention_triton"),
        (dispatch, "paged_decode_attention"),
        (dispatch, "paged_prefill_attention"),
        (dispatch.conv_triton, "causal_conv_scan"),
        (dispatch.delta_triton, "gated_delta_scan"),
        (dispatch.kda_triton, "kda_scan"),
        (dispatch.mamba2_triton, "mamba2_scan"),
        (dispatch.matmul, "invariant_matmul"),
    ]:
        monkeypatch.setattr(module, name, boom)


def test_cpu_attention_is_the_layer_path(no_triton):
    gen = case_generator("dispatch attention")
    batch, num_blocks = make_batch([1, 4, 0], [9, 21, 3], 8, gen)
    layer = layer_attention.PagedAttention(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)
    caches = [layer.spec.allocate(num_blocks, 8, torch.float32, CPU) for _ in range(2)]
    for cache in caches:
        for t in cache:
            t.copy_(randn(*t.shape, dtype=torch.float32, device=CPU, gen=case_generator("cache")))
    layer.bind_cache(caches[0])
    q, k, v = (randn(5, h, 16, dtype=torch.float32, device=CPU, gen=gen) for h in (4, 2, 2))
    expected = layer(q, k, v, batch)
    k_cache, v_cache = caches[1]
    dispatch.write_cache(k_cache, k, batch.slot_mapping)
    dispatch.write_cache(v_cache, v, batch.slot_mapping)
    assert torch.equal(k_cache, caches[0][0]) and torch.equal(v_cache, caches[0][1])
    assert torch.equal(dispatch.paged_attention(q, k_cache, v_cache, batch, 0.25), expected)


def test_cpu_norm_rotary_and_moe_are_the_layer_path(no_triton):
    gen = case_generator("dispatch layers")
    norm = RMSNorm(24, 1e-5)
    norm.weight.copy_(randn(24, dtype=torch.float32, device=CPU, gen=gen))
    x = randn(3, 24, dtype=torch.float32, device=CPU, gen=gen)
    assert torch.equal(dispatch.rms_norm(x, norm.weight, norm.eps), norm(x))
    normed, summed = dispatch.add_rms_norm(x, x * 0.5, norm.weight, norm.eps)
    assert torch.equal(summed, x + x * 0.5) and torch.equal(normed, norm(x + x * 0.5))

    rope = RotaryEmbedding(32, RopeConfig(partial_rotary_factor=0.5), 4096)
    q, k = (
        randn(3, 4, 32, dtype=torch.bfloat16, device=CPU, gen=gen),
        randn(3, 1, 32, dtype=torch.bfloat16, device=CPU, gen=gen),
    )
    positions = torch.tensor([0, 5, 900])
    got = dispatch.apply_rotary(positions, q, k, rope.inv_freq, rope.attention_scaling, rope.interleaved)
    want = rope(positions, q, k)
    assert all(torch.equal(a, b) for a, b in zip(got, want))

    routing = RoutingConfig(
        num_experts=8,
        top_k=2,
        scoring="sigmoid",
        norm_topk_prob=True,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.5,
    )
    router = Router(24, routing)
    router.weight.copy_(randn(8, 24, dtype=torch.float32, device=CPU, gen=gen))
    router.e_score_correction_bias.copy_(randn(8, dtype=torch.float32, device=CPU, gen=gen, scale=0.1))
    logits = invariant_linear(x.float(), router.weight.float())
    got = dispatch.grouped_topk(logits, router.e_score_correction_bias, 2, 2, 1, True, 1.5)
    assert all(torch.equal(a, b) for a, b in zip(got, router(x)))

    experts = Experts(8, 24, 16, ParallelContext())
    for p in (experts.gate_proj, experts.up_proj, experts.down_proj):
        p.copy_(randn(*p.shape, dtype=torch.float32, device=CPU, gen=gen, scale=0.2))
    weights, ids = router(x)
    got = dispatch.moe_experts(x, weights, ids, experts.gate_proj, experts.up_proj, experts.down_proj, invariant_linear)
    assert torch.equal(got, experts(x, weights, ids))
    projections = (experts.gate_proj, experts.up_proj, experts.down_proj)
    clamped = dispatch.moe_experts(x, weights, ids, *projections, invariant_linear, swiglu_limit=0.1)
    assert torch.equal(clamped, fused_moe.fused_moe_torch(x, weights, ids, *projections, invariant_linear, limit=0.1))
    assert not torch.equal(clamped, got)


def test_cpu_mla_is_the_layer_path(no_triton):
    gen = case_generator("dispatch mla")
    dims = MLADims(
        hidden_size=32,
        num_heads=2,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
    )
    layer = MLAAttention(dims, RotaryEmbedding(4, RopeConfig(), 4096, interleaved=True), 0.3, ParallelContext())
    layer.kv_b_proj.weight.copy_(randn(*layer.kv_b_proj.weight.shape, dtype=torch.float32, device=CPU, gen=gen))
    batch, num_blocks = make_batch([1, 3], [6, 11], 4, gen)
    tables, lens = batch.block_tables, batch.context_lens
    (cache,) = layer.spec.allocate(num_blocks, 4, torch.float32, CPU)
    cache.copy_(randn(*cache.shape, dtype=torch.float32, device=CPU, gen=gen))
    q_nope, q_rot = (
        randn(4, 2, 8, dtype=torch.float32, device=CPU, gen=gen),
        randn(4, 2, 4, dtype=torch.float32, device=CPU, gen=gen),
    )
    q = torch.cat([q_nope, q_rot], dim=-1)

    def expand(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The layer's own math: kv_b_proj expands the latent; the rope key is shared by every head.
        kv_nope, k_rot = latent.split([16, 4], dim=-1)
        k_nope, values = layer.kv_b_proj(kv_nope).view(latent.shape[0], 2, 16).split([8, 8], dim=-1)
        return torch.cat([k_nope, k_rot[:, None, :].expand(-1, 2, -1)], dim=-1), values

    expected = torch.cat(
        [
            attention_torch.causal_attention(q[s:e], *expand(attention_torch.gather_cache(cache, t, n)), 0.3)
            for (s, e), n, t in zip(attention_torch.sequence_spans(batch.query_lens), lens, tables)
        ]
    )
    got = dispatch.mla_attention(q_nope, q_rot, cache, batch, 0.3, layer.kv_b_proj.weight, 8, kv_b=layer.kv_b_proj)
    assert torch.equal(got, expected)


def test_cpu_projections_keep_the_torch_path(no_triton):
    """bf16 and float32 weights not packed for the CPU kernels run torch's tiled GEMMs, bit for bit."""
    gen = case_generator("dispatch linear")
    for dtype in (torch.float32, torch.bfloat16):
        x, weight = randn(5, 48, dtype=dtype, device=CPU, gen=gen), randn(24, 48, dtype=dtype, device=CPU, gen=gen)
        assert torch.equal(invariant_linear(x, weight), matmul.matmul_torch(x, weight))


def test_the_engine_configs_cuda_matmul_is_the_processes(monkeypatch):
    """The `cuda_matmul` setting reaches dispatch where a rank is built (in process here; rank actors alike)."""
    from deployments.config import EngineConfig
    from deployments.model_rank import executor

    monkeypatch.setattr(dispatch, "_CUDA_MATMUL", ["invariant"])
    monkeypatch.setattr(executor, "ModelRunner", lambda *args, **kwargs: None)  # no model: the setting alone
    monkeypatch.setattr(executor, "use_engine_threads", lambda *args: 1)
    executor.InProcessExecutor(EngineConfig(model="unused", cuda_matmul="cublas"))
    assert dispatch._CUDA_MATMUL == ["cublas"]


def test_an_unknown_cuda_matmul_is_refused():
    with pytest.raises(ValueError, match="cuda_matmul='cutlass': expected one of invariant, cublas"):
        dispatch.use_cuda_matmul("cutlass")


@pytest.fixture
def forced_triton(monkeypatch):
    pytest.importorskip("triton", reason="Triton is not importable", exc_type=ImportError)
    monkeypatch.setenv("TENSORFOLD_KERNELS", "triton")


def test_triton_route_over_a_mixed_step(forced_triton):
    """Decode (1 new token), drafts (3), a prefill chunk over a prefix (20) and an idle sequence (0)."""
    gen = case_generator("dispatch triton")
    query_lens, context_lens, block_size = [1, 3, 20, 0], [30, 20, 37, 5], 8
    batch, num_blocks = make_batch(query_lens, context_lens, block_size, gen, DEVICE)
    tables = batch.block_tables
    k_cache = paged_cache((1, 32), tables, context_lens, num_blocks, block_size, torch.bfloat16, DEVICE, gen)
    v_cache = paged_cache((1, 32), tables, context_lens, num_blocks, block_size, torch.bfloat16, DEVICE, gen)
    k_new = randn(24, 1, 32, dtype=torch.bfloat16, device=DEVICE, gen=gen)
    dispatch.write_cache(k_cache, k_new, batch.slot_mapping)  # overwrite the new tokens' slots
    assert torch.equal(k_cache.view(-1, 1, 32)[batch.slot_mapping], k_new)
    q = randn(24, 4, 32, dtype=torch.bfloat16, device=DEVICE, gen=gen)
    out = dispatch.paged_attention(q, k_cache, v_cache, batch, 32**-0.5)
    ref = attention_torch.paged_attention_torch(
        q.double(), k_cache.double(), v_cache.double(), query_lens, context_lens, tables, 32**-0.5
    )
    assert_close(out, ref, torch.bfloat16)
    meta = dispatch.step_meta(batch, block_size, DEVICE, dispatch.DECODE_MAX_QUERY)
    assert (meta.num_rows, meta.num_prefill) == (4, 1)
    assert dispatch.step_meta(batch, block_size, DEVICE, dispatch.DECODE_MAX_QUERY) is meta  # built once per step

    latent = paged_cache((24,), tables, context_lens, num_blocks, block_size, torch.float32, DEVICE, gen)
    q_nope, q_rot = (
        randn(24, 2, 8, dtype=torch.float32, device=DEVICE, gen=gen),
        randn(24, 2, 8, dtype=torch.float32, device=DEVICE, gen=gen),
    )
    w = randn(2 * (8 + 16), 16, dtype=torch.float32, device=DEVICE, gen=gen, scale=0.25)
    out = dispatch.mla_attention(q_nope, q_rot, latent, batch, 0.25, w, 16)
    ref = mla_decode.mla_attention_torch(
        q_nope.double(),
        q_rot.double(),
        latent.double(),
        query_lens,
        context_lens,
        tables,
        0.25,
        mla_decode.default_kv_b(w.double()),
        16,
    )
    assert_close(out, ref, torch.float32)


def test_projections_take_the_invariant_matmul_on_the_triton_route_unless_cublas(forced_triton, monkeypatch):
    monkeypatch.setattr(dispatch, "_CUDA_MATMUL", ["invariant"])  # this process's setting, restored after
    gen = case_generator("dispatch triton linear")
    x = randn(3, 5, 48, dtype=torch.bfloat16, device=DEVICE, gen=gen)  # [..., K]: leading dims flatten
    weight, bias = (
        randn(24, 48, dtype=torch.bfloat16, device=DEVICE, gen=gen),
        randn(24, dtype=torch.bfloat16, device=DEVICE, gen=gen),
    )
    rows = x.reshape(15, 48)
    assert torch.equal(invariant_linear(x, weight, bias), (matmul.invariant_matmul(rows, weight) + bias).view(3, 5, 24))
    dispatch.use_cuda_matmul("cublas")
    assert torch.equal(invariant_linear(x, weight), matmul.matmul_torch(rows, weight).view(3, 5, 24))


@pytest.mark.parametrize("arch", ["qwen3_5_text", "nemotron_h"])  # a Gated DeltaNet layer, a Mamba2 layer
def test_recurrent_layer_on_the_triton_route(arch, forced_triton, monkeypatch, tmp_path):
    """A tiny checkpoint's first recurrent layer over a step (a prefill chunk with a capture, a decode row, a
    second prefill) from random slot states: Triton's outputs and slots equal the torch path's."""
    pytest.importorskip("transformers")
    # The projections around the recurrence take the torch path in both runs (their inputs to the conv must be
    # the same bits): this test is about the recurrent kernels; the matmul has its own (test_kernels_matmul.py).
    monkeypatch.setattr(dispatch, "_CUDA_MATMUL", ["cublas"])
    from deployments.model_rank.layers.recurrent import RecurrentMixer
    from deployments.model_rank.models import load_model
    from serve_app.fixtures.checkpoints import build_random_checkpoint
    from tests.support.model_harness import PagedHarness

    model = load_model(build_random_checkpoint(arch, tmp_path / "ck"), dtype="float32", device=DEVICE)
    harness = PagedHarness(model, num_slots=6)
    batch = harness.batch([(0, list(range(2, 11))), (1, [5]), (2, [7, 8, 9])], captures=[[(4, 5)], [], []])
    batch = replace(batch, **{name: getattr(batch, name).to(DEVICE) for name in ON_DEVICE})  # as the runner's
    mixer = next(m for m in model.modules() if isinstance(m, RecurrentMixer))
    gen = case_generator("recurrent layer", arch)
    for pool in (mixer.conv_pool, mixer.state_pool):
        pool.copy_(randn(*pool.shape, dtype=pool.dtype, device=DEVICE, gen=gen, scale=0.5))
    hidden = randn(13, model.config.hidden_size, dtype=torch.float32, device=DEVICE, gen=gen)
    initial = (mixer.conv_pool.clone(), mixer.state_pool.clone())

    def run(mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        monkeypatch.setenv("TENSORFOLD_KERNELS", mode)
        mixer.conv_pool.copy_(initial[0])
        mixer.state_pool.copy_(initial[1])
        return mixer(hidden, batch), mixer.conv_pool.clone(), mixer.state_pool.clone()

    want, got = run("torch"), run("triton")
    assert not torch.equal(want[2][5], initial[1][5])  # the capture slot was written
    assert_close(got[0], want[0], torch.float32, "layer output")
    assert torch.equal(got[1], want[1])  # conv histories are copies of inputs
    assert_close(got[2], want[2], torch.float32, "state slots")


def test_wide_conv_stays_on_torch(forced_triton):
    """Conv widths past the Triton kernel's registers run the torch path (same bits)."""
    gen = case_generator("wide conv")
    x, pool = (
        randn(5, 8, dtype=torch.float32, device=DEVICE, gen=gen),
        randn(3, 4, 8, dtype=torch.float32, device=DEVICE, gen=gen),
    )
    weight = randn(8, 5, dtype=torch.float32, device=DEVICE, gen=gen)
    rows = recurrent_scan.ScanRows((0, 3), (3, 5), (0, 2))
    expected_pool = pool.clone()
    expected = recurrent_scan.causal_conv_scan(x, expected_pool, weight, None, rows)
    assert torch.equal(dispatch.causal_conv_scan(x, pool, weight, None, rows), expected)
    assert torch.equal(pool, expected_pool)


def test_kda_scan_takes_the_triton_kernel(forced_triton, monkeypatch):
    """On the Triton route dispatch.kda_scan runs kernels/kda_scan.py over the step's metadata."""
    gen = case_generator("dispatch kda")
    q, k, g = (randn(4, 2, 8, dtype=torch.float32, device=DEVICE, gen=gen, scale=0.3) for _ in range(3))
    v, beta = randn(4, 2, 8, dtype=torch.float32, device=DEVICE, gen=gen), torch.full((4, 2), 0.5, device=DEVICE)
    rows = recurrent_scan.ScanRows((0, 3), (3, 4), (0, 2), ((1, 1),))
    pool = randn(3, 2, 8, 8, dtype=torch.float32, device=DEVICE, gen=gen)
    called = []
    kernel = dispatch.kda_triton.kda_scan
    monkeypatch.setattr(dispatch.kda_triton, "kda_scan", lambda *args: called.append(args) or kernel(*args))
    got_pool, want_pool = pool.clone(), pool.clone()
    got = dispatch.kda_scan(got_pool, q, k, v, -g.abs(), beta, rows)
    want = recurrent_scan.kda_scan(want_pool, q, k, v, -g.abs(), beta, rows)
    assert len(called) == 1
    assert_close(got, want, torch.float32)
    assert_close(got_pool, want_pool, torch.float32, "state slots")


def test_scan_meta_is_built_once_per_step():
    """Every recurrent call of a step (equal ScanRows, one per layer) shares one device copy."""
    x = torch.zeros(4, 2, device=DEVICE)
    meta = dispatch.scan_meta(recurrent_scan.ScanRows((0, 3), (3, 4), (0, 1), ((1, 2),)), x)
    assert dispatch.scan_meta(recurrent_scan.ScanRows((0, 3), (3, 4), (0, 1), ((1, 2),)), x) is meta
    assert dispatch.scan_meta(recurrent_scan.ScanRows((0, 3), (3, 4), (1, 0), ((1, 2),)), x) is not meta


def test_mrope_on_the_triton_route_picks_image_rows_on_the_device(forced_triton, monkeypatch):
    """Which rows are image placeholders is decided on the device (no host read): text rows keep plain
    RoPE's bits, image rows are turned by the three-axis table as on the torch route."""
    gen = case_generator("mrope")
    rotary = RotaryEmbedding(32, RopeConfig(partial_rotary_factor=0.5, mrope_section=(2, 1, 1)), 4096)
    q = randn(6, 4, 32, dtype=torch.float32, device=DEVICE, gen=gen)
    k = randn(6, 2, 32, dtype=torch.float32, device=DEVICE, gen=gen)
    positions = torch.arange(10, 16, device=DEVICE)
    three = positions.expand(3, -1).clone()
    three[1, 2:4] += 7  # rows 2 and 3: an image's placeholders
    three[2, 3] += 2
    with no_host_sync():
        q_out, k_out = rotary(positions, q, k, three)
    plain_q, plain_k = rotary(positions, q, k)
    text = [0, 1, 4, 5]
    assert torch.equal(q_out[text], plain_q[text]) and torch.equal(k_out[text], plain_k[text])
    monkeypatch.setenv("TENSORFOLD_KERNELS", "torch")
    ref_q, ref_k = rotary(positions, q, k, three)
    assert_close(q_out, ref_q, torch.float32)
    assert_close(k_out, ref_k, torch.float32)
    assert not torch.equal(q_out[2:4], plain_q[2:4])

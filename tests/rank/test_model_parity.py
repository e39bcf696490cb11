"""Model code against transformers on tiny random checkpoints, batch invariance, and tensor parallelism;
for hybrid models (HYBRID_ARCHS) also their recurrent states captured after a row and resumed elsewhere;
sliding-window models (WINDOW_ARCHS) with prompts four windows long."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from deployments.model_rank.layers.linear import invariant_linear
from deployments.model_rank.models import load_model
from kernels import cpu_gemm
from serve_app.fixtures.archs import ARCHS, HYBRID_ARCHS, WINDOW_ARCHS
from serve_app.fixtures.checkpoints import build_random_checkpoint
from tests.support.kernel_levels import other_kernel_levels
from tests.support.model_harness import PagedHarness, tp_worker
from tests.support.reference import hf_model

transformers = pytest.importorskip("transformers")
PROMPT_LEN, NEW_TOKENS = 64, 32
ALL_ARCHS = ARCHS + HYBRID_ARCHS + WINDOW_ARCHS  # hybrids run with a state slot per sequence (PagedHarness)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    # Two shared cores: intra-op threads only spin against other processes here.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parity")
    return {arch: build_random_checkpoint(arch, root / arch) for arch in ALL_ARCHS}


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(2, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()


def hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()  # [T, V]


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_logits_and_greedy_match_transformers(arch: str, checkpoints: dict[str, Path], prompt: list[int]) -> None:
    reference = hf_model(checkpoints[arch])
    model = load_model(checkpoints[arch], dtype="float32")
    ours = PagedHarness(model).step([(0, prompt)], all_logits=True)  # [64, V]
    assert (ours - hf_logits(reference, prompt)).abs().max().item() < 1e-4
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    expected = out[0, PROMPT_LEN:].tolist()
    assert len(expected) == NEW_TOKENS
    assert PagedHarness(model).generate(0, prompt, NEW_TOKENS) == expected
    assert PagedHarness(model).generate(0, prompt, NEW_TOKENS, chunk=7) == expected


VARIANTS = {
    "llama-rope-llama3": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            )
        ),
    ),
    "llama-rope-linear": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0))),
    "qwen3_moe-no-norm-topk": ("qwen3_moe", dict(norm_topk_prob=False, mlp_only_layers=[])),
    "glm4_moe-plain": (
        "glm4_moe",
        dict(
            use_qk_norm=False,
            attention_bias=False,
            n_group=1,
            topk_group=1,
            num_nextn_predict_layers=0,
            partial_rotary_factor=1.0,
        ),
    ),
    "glm4_moe_lite-no-q-lora-yarn": (
        "glm4_moe_lite",
        dict(
            q_lora_rank=None,
            rope_interleave=False,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                mscale=1.0,
                mscale_all_dim=1.0,
                original_max_position_embeddings=256,
            ),
        ),
    ),
    # Hybrids. One value head per key head, routing without renormalisation, MoE every second layer, biased
    # attention projections, a 2-tap conv.
    "qwen3_next-plain-heads": (
        "qwen3_next",
        dict(
            linear_num_value_heads=2,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            mlp_only_layers=[],
            attention_bias=True,
            linear_conv_kernel_dim=2,
        ),
    ),
    "qwen3_5_text-tied-full-rope-attention-first": (
        "qwen3_5_text",
        dict(
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=1.0),
            layer_types=["full_attention", "linear_attention", "linear_attention"],
        ),
    ),
    "qwen3_5_moe-three-value-heads-per-key": ("qwen3_5_moe", dict(linear_num_value_heads=6, linear_value_head_dim=8)),
    # No latent MoE, one B/C group, ungrouped routing without normalised weights, no MTP.
    "nemotron_h-plain": (
        "nemotron_h",
        dict(
            moe_latent_size=None, n_groups=1, n_group=1, topk_group=1, norm_topk_prob=False, num_nextn_predict_layers=0
        ),
    ),
    # Attention first, every bias on (Mamba2 in/out, MLP, shared expert, latent projections), no conv bias.
    "nemotron_h-biases": (
        "nemotron_h",
        dict(hybrid_override_pattern="*ME-M", use_bias=True, mlp_bias=True, use_conv_bias=False),
    ),
    # Gemma 4 without per-layer inputs, shared KV, K-as-V or a softcap; transformers' default layer pattern
    # (the last forced full), and full layers turning half their pairs. Three layers: six sandwich-normed
    # ones put transformers' own float32 logits 1.5e-4 from float64, past this test's bar (the fixture has four).
    "gemma4_text-plain": (
        "gemma4_text",
        dict(
            num_hidden_layers=3,
            hidden_size_per_layer_input=0,
            num_kv_shared_layers=0,
            attention_k_eq_v=False,
            final_logit_softcapping=None,
            layer_types=None,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e6},
            },
        ),
    ),
    # Gemma 4's expert block beside every MLP: four GELU-tanh experts, two per token.
    "gemma4_text-experts": (
        "gemma4_text",
        dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
    ),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_variants_match_transformers(variant: str, tmp_path: Path, prompt: list[int]) -> None:
    arch, overrides = VARIANTS[variant]
    path = build_random_checkpoint(arch, tmp_path / variant, seed=3, **overrides)
    ours = PagedHarness(load_model(path, dtype="float32")).step([(0, prompt)], all_logits=True)
    assert (ours - hf_logits(hf_model(path), prompt)).abs().max().item() < 1e-4


def test_glm_mtp_layer_matches_transformers(checkpoints: dict[str, Path], prompt: list[int]) -> None:
    from transformers.modeling_layers import MtpModel

    path = checkpoints["glm4_moe"]
    reference = hf_model(path)
    layers = reference.config.num_hidden_layers
    # transformers finds MTP tensors by the real models' layer numbers (46, 92); point it at the tiny one.
    reference._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{layers}\..*"]
    mtp = MtpModel.from_pretrained(reference).eval()
    tokens, following = prompt[:-1], prompt[1:]
    with torch.no_grad():
        hidden = reference.model(torch.tensor([tokens])).last_hidden_state
        positions = torch.arange(len(tokens))[None]
        mtp_hidden = mtp.forward_layer(0, hidden, positions, None, input_ids=torch.tensor([following]))
        expected = mtp._project_to_logits(mtp_hidden)
    model = load_model(path, dtype="float32")
    assert model.config.has_mtp and model.mtp is not None
    harness = PagedHarness(model)
    batch = harness.batch([(0, tokens)], all_logits=True)
    model.bind_mtp_kv_caches(harness.allocate(model.mtp_kv_cache_specs()))
    ours = model.mtp.compute_logits(model.mtp(model(batch), torch.tensor(following), batch))
    assert (ours - expected[0].float()).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# (in, out): without AMX, a lone bf16 row takes a GEMV of its own (64x64, 2048x768), and 32x32's rows
# differ between four and 64 rows.
@pytest.mark.parametrize("shape", [(96, 80), (64, 64), (2048, 768), (32, 32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_invariant_linear_rows_do_not_depend_on_row_count(
    dtype: torch.dtype, shape: tuple[int, int], threads: int
) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_rows_alone_and_together(dtype, shape)
    finally:
        torch.set_num_threads(previous)


def _check_rows_alone_and_together(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(24):
        x = torch.randn(64, shape[0], generator=gen).to(dtype)
        w = (torch.randn(shape[1], shape[0], generator=gen) * 0.05).to(dtype)
        for weight in [w, *_packed_copy(w)]:
            full = invariant_linear(x, weight)
            for rows in (1, 2, 3, 4, 5, 8, 17, 33):
                for start in (0, 64 - rows):
                    assert torch.equal(invariant_linear(x[start : start + rows], weight), full[start : start + rows])
            for row in range(64):  # every row alone
                assert torch.equal(invariant_linear(x[row : row + 1], weight), full[row : row + 1])


def _packed_copy(weight: torch.Tensor) -> list[torch.Tensor]:
    """The weight packed for the native GEMM, as a model's bf16 projections are at load (none if it cannot be)."""
    if not (cpu_gemm.available() and cpu_gemm.can_pack(weight)):
        return []
    copy = weight.clone()
    cpu_gemm.pack_(copy)
    return [copy]


# bf16 also at every lower kernel level (and torch's): each is its own build with its own bits.
@pytest.mark.parametrize(
    "dtype,kernels",
    [("float32", "auto"), ("bfloat16", "auto"), *(("bfloat16", level) for level in other_kernel_levels())],
)
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_last_token_logits_are_batch_invariant(
    arch: str, dtype: str, kernels: str, checkpoints: dict[str, Path], prompt: list[int], monkeypatch
) -> None:
    """Whole prefill, chunks of 1/5/7 with cached decode, and inside a mixed batch: bitwise equal."""
    monkeypatch.setenv("TENSORFOLD_KERNELS", kernels)
    model = load_model(checkpoints[arch], dtype=dtype)
    whole = PagedHarness(model).prefill(0, prompt)
    for chunk in (1, 5, 7):
        assert torch.equal(PagedHarness(model).prefill(0, prompt, chunk=chunk), whole), f"chunks of {chunk}"
    gen = torch.Generator().manual_seed(1)
    others = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (3, 29, 50)]
    harness = PagedHarness(model)
    harness.step([(1, others[0]), (2, others[1][:10])])
    harness.step([(1, [5]), (0, prompt[:40]), (2, others[1][10:]), (3, others[2])])
    batched = harness.step([(3, [7]), (2, [9]), (0, prompt[40:]), (1, [11])])  # decodes around a prefill chunk
    assert torch.equal(batched[2], whole)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_verify_rows_equal_serial_decode_rows(
    arch: str, dtype: str, checkpoints: dict[str, Path], prompt: list[int]
) -> None:
    """A verify round's rows over [last, d1..d4] are bitwise the rows serial decoding computes at those
    positions, alone or beside other sequences' decode and prefill rows (the drafts' exactness argument)."""
    model = load_model(checkpoints[arch], dtype=dtype)
    continuation = [17, 301, 45, 9, 260]
    serial = PagedHarness(model)
    serial.prefill(0, prompt)
    rows = torch.stack([serial.step([(0, [token])])[0] for token in continuation])  # [5, V], one step each
    alone = PagedHarness(model)
    alone.prefill(0, prompt)
    assert torch.equal(alone.step([(0, continuation)], all_logits=True), rows)
    mixed = PagedHarness(model)
    mixed.step([(1, prompt[:9]), (0, prompt)])
    verified = mixed.step([(1, [3]), (0, continuation), (2, prompt[5:30])], all_logits=True)  # [1 + 5 + 25, V]
    assert torch.equal(verified[1:6], rows)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_captured_states_resume_bit_identically(
    arch: str, dtype: str, checkpoints: dict[str, Path], prompt: list[int]
) -> None:
    """States captured after rows 15 and 31 of a prefill chunk (block boundaries, beside another sequence),
    copied into fresh sequences' slots, continue exactly as the run that never stopped; a capture after the
    chunk's last row equals the state the slot itself advanced to."""
    model = load_model(checkpoints[arch], dtype=dtype)
    uncut = PagedHarness(model).step([(0, prompt)], all_logits=True)  # [64, V]
    harness = PagedHarness(model)  # 16 slots: the sequences here take the first ones
    at_16, at_32, at_40 = 13, 14, 15
    captures = [[], [(15, at_16), (31, at_32), (39, at_40)]]
    harness.step([(1, prompt[::-1][:23]), (0, prompt[:40])], captures=captures)
    slot = harness.seqs[0].slot
    for conv, state in harness.state_pools:
        assert torch.equal(conv[at_40], conv[slot]) and torch.equal(state[at_40], state[slot])
    assert torch.equal(harness.step([(0, prompt[40:])], all_logits=True), uncut[40:])

    harness.resume(2, source_id=0, length=32, slot=at_32)
    assert torch.equal(harness.step([(2, prompt[32:])], all_logits=True), uncut[32:])
    harness.resume(3, source_id=0, length=16, slot=at_16)
    for start in range(16, PROMPT_LEN, 7):  # in chunks of 7, beside sequence 1's decode
        rows = harness.step([(1, [7]), (3, prompt[start : start + 7])], all_logits=True)[1:]
        assert torch.equal(rows, uncut[start : start + 7])


def _tensor_parallel_results(
    names: list[str], prompt: list[int], tmp_path: Path
) -> dict[str, tuple[torch.Tensor, list[int], torch.Tensor | None]]:
    """Each checkpoint run on two spawned ranks (gloo): rank 0's results (model_harness.tp_worker)."""
    out = tmp_path / "tp.pt"
    args = (2, str(tmp_path / "tp_init"), names, prompt, 16, str(out))
    mp.spawn(tp_worker, args=args, nprocs=2, join=True)
    return torch.load(out)


def test_tensor_parallel_matches_single_rank(checkpoints: dict[str, Path], prompt: list[int], tmp_path: Path) -> None:
    names = [str(checkpoints[arch]) for arch in ("qwen3", "glm4_moe", "qwen3_moe", "glm4_moe_lite")]
    results = _tensor_parallel_results(names, prompt[:24], tmp_path)
    for name in names:
        model = load_model(name, dtype="float32")
        logits, continuation, _ = results[name]
        expected = PagedHarness(model).step([(0, prompt[:24])], all_logits=True)
        assert (logits - expected).abs().max().item() < 1e-5, name
        assert continuation == PagedHarness(model).generate(0, prompt[:24], 16), name


def test_sliding_window_tensor_parallel_matches_single_rank(
    checkpoints: dict[str, Path], prompt: list[int], tmp_path: Path
) -> None:
    """Gemma 4 (sliding and full layers, a kv head replicated on both ranks, shared KV, per-layer inputs) over
    two ranks: equal greedy continuations, logits within 1e-4 of one rank's. The bar is the family's float32
    noise, not the 1e-5 above: a norm after each sublayer rescales the attention and MLP outputs (small
    vectors) to unit RMS, so the all-reduce's other summation order reaches the logits 60 ulps wide (1.4e-5
    on the fixture's first row); transformers' own float32 logits of a six-layer one lie 1.5e-4 from float64."""
    name = str(checkpoints["gemma4_text"])
    logits, continuation, _ = _tensor_parallel_results([name], prompt[:24], tmp_path)[name]
    model = load_model(name, dtype="float32")
    expected = PagedHarness(model).step([(0, prompt[:24])], all_logits=True)
    assert (logits - expected).abs().max().item() < 1e-4
    assert continuation == PagedHarness(model).generate(0, prompt[:24], 16)


def test_hybrid_tensor_parallel_matches_single_rank(
    checkpoints: dict[str, Path], prompt: list[int], tmp_path: Path
) -> None:
    """Gated DeltaNet (both projection layouts, dense and MoE) and Mamba2 models split by heads over two ranks:
    logits within 1e-5 of one rank's, equal greedy continuations, and on the ranks, states captured after
    row 15 and copied to another slot resume bit-identically to the uncut prefill."""
    names = [str(checkpoints[arch]) for arch in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe", "nemotron_h")]
    results = _tensor_parallel_results(names, prompt[:24], tmp_path)
    for name in names:
        model = load_model(name, dtype="float32")
        logits, continuation, resumed = results[name]
        expected = PagedHarness(model).step([(0, prompt[:24])], all_logits=True)
        assert (logits - expected).abs().max().item() < 1e-5, name
        assert continuation == PagedHarness(model).generate(0, prompt[:24], 16), name
        assert resumed is not None and torch.equal(resumed, logits[16:]), name

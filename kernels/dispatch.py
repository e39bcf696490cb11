"""What the model layers call: Triton on CUDA, a native CPU kernel where one takes the call, else torch.

Each function takes the arguments of the torch code it replaces and runs the Triton kernel when its tensors
are on CUDA (and Triton imports), else the CPU's native kernel where one takes the call (kernels/cpu_*.py: batch-invariant; RoPE, argmax and the causal conv with torch's bits), else
the plain-torch path, which computes exactly what the layers computed before.

`TENSORFOLD_KERNELS` picks the path: `auto` (default, as above), `torch` (always torch: a kill switch on
GPUs), `triton` (always Triton: on CPU this needs the interpreter, for tests), or a native CPU level
(`amx`, `avx512`, `avx2`, `neon`: kernels/cpu_native.py) forced instead of the best the CPU has, otherwise as `auto`.
The projections' matmul on CUDA is also the `cuda_matmul` setting's (`use_cuda_matmul`): the invariant Triton
kernel, or cuBLAS.
"""

import os
import weakref
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

# Modules named as dispatch's own functions, so aliased: the recurrent layers' Triton kernels.
import kernels.causal_conv_scan as conv_triton
import kernels.gated_delta_scan as delta_triton
import kernels.kda_scan as kda_triton
import kernels.mamba2_scan as mamba2_triton
from kernels import (
    attention_torch,
    cpu_attention,
    cpu_layer_ops,
    cpu_native,
    cpu_recurrent,
    fused_moe,
    hyper_mix,
    kv_write,
    matmul,
    mla_decode,
    moe_routing,
    recurrent_scan,
    rmsnorm,
    rotary,
    sparse_mla,
)
from kernels._triton import HAS_TRITON
from kernels.activation import gelu_tanh, silu
from kernels.paged_decode_attention import paged_decode_attention
from kernels.paged_meta import ALL_ROWS, DECODE_MAX_QUERY, PagedMeta, build_paged_meta
from kernels.paged_prefill_attention import paged_prefill_attention
from kernels.recurrent_scan import ScanRows
from kernels.scan_meta import ScanMeta, build_scan_meta

MODES = ("auto", "torch", "triton", *(level.name for level in cpu_native.LEVELS))
CUDA_MATMULS = ("invariant", "cublas")  # deployments/config.py's `cuda_matmul`


class StepLayout(Protocol):
    """The parts of deployments.model_rank.forward_batch.ForwardBatch that attention reads."""

    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor
    paged: dict[int, PagedMeta]  # the step's metadata per row limit, built before the layers (may be empty)


_MODES: dict[str, str] = {}  # TENSORFOLD_KERNELS as set -> its mode (asked several times per layer and step)


def mode() -> str:
    setting = os.environ.get("TENSORFOLD_KERNELS", "auto")
    if setting not in _MODES:
        value = setting.strip().lower() or "auto"
        if value not in MODES:
            raise ValueError(f"TENSORFOLD_KERNELS={value!r}: expected one of {', '.join(MODES)}")
        _MODES[setting] = value
    return _MODES[setting]


def backend(*tensors: torch.Tensor) -> str:
    """ "triton" or "torch" for a call on these tensors."""
    chosen = mode()
    if chosen == "torch":
        return "torch"
    if chosen == "triton":
        if not HAS_TRITON:
            raise RuntimeError("TENSORFOLD_KERNELS=triton but Triton is not installed")
        return "triton"
    return "triton" if HAS_TRITON and all(t.is_cuda for t in tensors) else "torch"


_CUDA_MATMUL = ["invariant"]  # the process's `cuda_matmul` (one model per process)


def use_cuda_matmul(choice: str) -> None:
    """The projections' matmul on CUDA from now on: `invariant` (kernels/matmul.py) or `cublas`."""
    if choice not in CUDA_MATMULS:
        raise ValueError(f"cuda_matmul={choice!r}: expected one of {', '.join(CUDA_MATMULS)}")
    _CUDA_MATMUL[0] = choice


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """layers/linear.py's GEMM for weights not packed for the CPU: x [M, K] @ weight [N, K]^T -> [M, N], on
    the batch-invariant Triton matmul unless `cuda_matmul` is cublas (or the tensors are not on CUDA)."""
    if _CUDA_MATMUL[0] == "invariant" and backend(x, weight) == "triton":
        return matmul.invariant_matmul(x, weight)
    return matmul.matmul_torch(x, weight)


# The last step's metadata per row limit: every attention layer of a forward pass shares one batch.
_META: dict[int, tuple[weakref.ref, torch.Tensor, PagedMeta]] = {}


def step_meta(batch: StepLayout, block_size: int, device: torch.device, row_query_limit: int) -> PagedMeta:
    """The batch's kernel metadata: what its runner built before the layers, else built here once per step
    (keyed on the batch object and its slot mapping) for batches made by hand."""
    if row_query_limit in batch.paged:
        return batch.paged[row_query_limit]
    hit = _META.get(row_query_limit)
    if hit is not None and hit[0]() is batch and hit[1] is batch.slot_mapping:
        return hit[2]
    meta = build_paged_meta(
        batch.query_lens, batch.context_lens, batch.block_tables, block_size, device, row_query_limit
    )
    _META[row_query_limit] = (weakref.ref(batch), batch.slot_mapping, meta)
    return meta


# The last step's recurrent metadata: a step's recurrent layers (and each layer's conv and scan) share it.
_SCAN: list[tuple[ScanRows, int, torch.device, ScanMeta]] = []


def scan_meta(rows: ScanRows, step_rows: torch.Tensor) -> ScanMeta:
    """`rows` as device tensors for a step whose flat tensors are `step_rows` [T, ...], built once per step."""
    key = (rows, step_rows.shape[0], step_rows.device)
    if _SCAN and _SCAN[0][:3] == key:
        return _SCAN[0][3]
    meta = build_scan_meta(rows, step_rows.shape[0], step_rows.device)
    _SCAN[:] = [(*key, meta)]
    return meta


def use_scan_meta(rows: ScanRows, meta: ScanMeta) -> None:
    """A step's recurrent metadata built before its layers (deployments/model_rank/device_batch.py): the
    layers' calls over these rows find it instead of building it in the first of them."""
    _SCAN[:] = [(rows, meta.total_rows, meta.starts.device, meta)]


def write_cache(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Replaces layers/attention.py write_cache(cache, values, slot_mapping)."""
    if backend(cache, values) == "triton":
        kv_write.write_cache(cache, values, slot_mapping)
    else:
        kv_write.write_cache_torch(cache, values, slot_mapping)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: StepLayout, scale: float, window: int = 0
) -> torch.Tensor:
    """Replaces PagedAttention.forward's per-sequence loop: q [T, Hq, D] -> [T, Hq, Dv] (K/V already written);
    `window` > 0: each query sees the keys of its last `window` positions only (a sliding-window layer)."""
    if backend(q, k_cache) == "torch":
        if cpu_attention.supports(q, k_cache, v_cache):
            layout = cpu_attention.row_layout(batch.query_lens, batch.context_lens, batch.block_tables, batch)
            return cpu_attention.paged_attention(q, k_cache, v_cache, layout, scale, window)
        return attention_torch.paged_attention_torch(
            q, k_cache, v_cache, batch.query_lens, batch.context_lens, batch.block_tables, scale, window
        )
    meta = step_meta(batch, k_cache.shape[1], q.device, DECODE_MAX_QUERY)
    out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[3], dtype=q.dtype, device=q.device)
    paged_decode_attention(q, k_cache, v_cache, meta, scale, out, window=window)
    paged_prefill_attention(q, k_cache, v_cache, meta, scale, out, window=window)
    return out


def mla_attention(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    latent_cache: torch.Tensor,
    batch: StepLayout,
    scale: float,
    kv_b_weight: torch.Tensor,
    v_dim: int,
    kv_b: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Replaces MLAAttention.forward's per-sequence loop: -> [T, H, v] (latents already written).

    kv_b: the layer's kv_b_proj (the torch path expands latents with it); Triton absorbs kv_b_weight.
    """
    if backend(q_nope, latent_cache) == "torch":
        expand = kv_b if kv_b is not None else mla_decode.default_kv_b(kv_b_weight)
        return mla_decode.mla_attention_torch(
            q_nope, q_rot, latent_cache, batch.query_lens, batch.context_lens, batch.block_tables, scale, expand, v_dim
        )
    meta = step_meta(batch, latent_cache.shape[1], q_nope.device, ALL_ROWS)
    return mla_decode.mla_attention_triton(q_nope, q_rot, latent_cache, meta, scale, kv_b_weight, v_dim)


def sparse_mla_attention(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    latent_cache: torch.Tensor,
    batch: StepLayout,
    scale: float,
    absorbed: tuple[torch.Tensor, torch.Tensor],
    keeps: list[torch.Tensor],
) -> torch.Tensor:
    """MLA over each query's DSA selection only (kernels/sparse_mla.py): -> [T, H, v]."""
    lens, tables = batch.context_lens, batch.block_tables
    return sparse_mla.sparse_mla_torch(
        q_nope, q_rot, latent_cache, batch.query_lens, lens, tables, scale, *absorbed, keeps
    )


def hyper_weights(
    mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A hyper-connection block's (pre, post, comb) per token (kernels/hyper_mix.py): native on CPU."""
    if backend(mix, base) == "torch" and hyper_mix.native_supported(mix, base, scale, n):
        return hyper_mix.hyper_weights_native(mix, base, scale, n, iters, eps)
    return hyper_mix.hyper_weights_torch(mix, base, scale, n, iters, eps)


def hyper_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """A block's input [T, H] from its streams [T, n, H] (kernels/hyper_mix.py): native on CPU."""
    if backend(streams, pre) == "torch" and hyper_mix.native_streams(streams, pre):
        return hyper_mix.collapse_native(streams, pre)
    return hyper_mix.collapse_torch(streams, pre)


def hyper_merge(streams: torch.Tensor, block: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a block (kernels/hyper_mix.py): native on CPU."""
    if backend(streams, block) == "torch" and hyper_mix.native_streams(streams, block, post, comb):
        return hyper_mix.merge_native(streams, block, post, comb)
    return hyper_mix.merge_torch(streams, block, post, comb)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Replaces RMSNorm.forward's body."""
    if backend(x, weight) == "triton":
        return rmsnorm.rms_norm(x, weight, eps)
    if _native_norm(x, weight):
        return cpu_layer_ops.rms_norm(x, weight, eps)[0]
    return rmsnorm.rms_norm_torch(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual): replaces `h = h + out` followed by `norm(h)`."""
    if backend(x, residual, weight) == "triton":
        return rmsnorm.add_rms_norm(x, residual, weight, eps)
    if _native_norm(x, weight) and cpu_layer_ops.supports(x, residual) and residual.shape == x.shape:
        return cpu_layer_ops.rms_norm(x, weight, eps, residual)
    return rmsnorm.add_rms_norm_torch(x, residual, weight, eps)


def wide_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled in float32 and rounded once (WideScaleRMSNorm's convention): one native call on CPU in
    bfloat16/float16, else torch's ops."""
    if backend(x, weight) == "torch" and _native_norm(x, weight):
        return cpu_layer_ops.rms_norm_wide(x, weight, eps)
    return rmsnorm.wide_rms_norm_torch(x, weight.float(), eps)


def _native_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The CPU native RMSNorm takes x [..., H] and weight [H] of one narrow dtype (float32 keeps torch's bits)."""
    return (
        x.dtype in cpu_layer_ops.NARROW
        and weight.dim() == 1
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[0]
        and cpu_layer_ops.supports(x, weight)
    )


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: the gated MLP's activation (one native call on CPU, also over a fused gate/up output's
    two halves)."""
    if gate.dtype in cpu_layer_ops.NARROW and gate.dtype == up.dtype and backend(gate, up) == "torch":
        stride = cpu_layer_ops.rows_of(gate, up)
        if stride is not None and gate.device.type == "cpu" and cpu_native.available():
            return cpu_layer_ops.silu_mul(gate, up, stride)
    return silu(gate) * up


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up: Gemma's gated MLP activation (one native call on CPU in bfloat16/float16; float32
    keeps kernels/activation.py's composed GELU)."""
    if gate.dtype in cpu_layer_ops.NARROW and gate.dtype == up.dtype and backend(gate, up) == "torch":
        stride = cpu_layer_ops.rows_of(gate, up)
        if stride is not None and gate.device.type == "cpu" and cpu_native.available():
            return cpu_layer_ops.gelu_tanh_mul(gate, up, stride)
    return gelu_tanh(gate) * up


def apply_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RotaryEmbedding.forward: q [T, Hq, D], k [T, Hk, D] rotated at their positions."""
    if backend(q, k) == "triton":
        return rotary.rotary(positions, q, k, inv_freq, attention_scaling, interleaved)
    if not interleaved and q.dim() == k.dim() == 3 and cpu_layer_ops.supports(q, k):
        return cpu_layer_ops.rotary(positions, q, k, inv_freq, attention_scaling)
    return rotary.rotary_torch(positions, q, k, inv_freq, attention_scaling, interleaved)


def apply_mrope(
    positions: torch.Tensor,
    three: torch.Tensor,
    axes: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rotate-half RoPE: rows' positions [3, T], pair j turning with row axes[j]. Every row goes
    through `apply_rotary` at `positions` (the temporal row), so a text row (three equal positions) gets
    its bits on every device; rows whose positions differ (image placeholders) are redone by the table."""
    q_out, k_out = apply_rotary(positions, q, k, inv_freq, attention_scaling, False)
    image = (three != three[0]).any(dim=0)  # [T]
    if backend(q, k) == "triton":
        # Every row's table, each row then picked on the device: no host read of which rows are images.
        # (CUDA's elementwise kernels give a row the same bits wherever it sits; CPU's vector loops do not.)
        cos, sin = rotary.mrope_cos_sin(three, axes, inv_freq, attention_scaling, q.dtype)  # [T, 1, rot]
        q_image, k_image = rotary.rotate_with_table(q, k, cos, sin)
        return torch.where(image[:, None, None], q_image, q_out), torch.where(image[:, None, None], k_image, k_out)
    rows = image.nonzero().squeeze(1)
    if rows.numel():
        cos, sin = rotary.mrope_cos_sin(three[:, rows], axes, inv_freq, attention_scaling, q.dtype)  # [n, 1, rot]
        q_image, k_image = rotary.rotate_with_table(q[rows], k[rows], cos, sin)
        q_out[rows], k_out[rows] = q_image, k_image
    return q_out, k_out


def grouped_topk(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replaces Router._grouped_sigmoid after its router GEMM: logits [T, E] float32 -> weights, ids [T, k]."""
    args = (logits, correction_bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    if backend(logits) == "triton":
        return moe_routing.grouped_topk(*args)
    return moe_routing.grouped_topk_torch(*args)


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_proj: torch.Tensor | None,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
    activation: str = "silu",
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Replaces Experts.forward: x [T, H], weights/ids [T, k] -> [T, H]; `linear` is used by the torch path.
    `gate_proj` None: relu^2 experts without a gate (layers/latent_moe.py); `activation`: the gate's
    (fused_moe.ACTIVATIONS); `swiglu_limit`: SiLU experts' clamp of gate and up (fused_moe_torch's `limit`)."""
    fused_moe.check_swiglu_limit(activation, gate_proj is not None, swiglu_limit)
    if backend(x, up_proj) == "triton":
        return fused_moe.fused_moe(
            x, weights, ids, gate_proj, up_proj, down_proj, activation=activation, limit=swiglu_limit
        )
    if gate_proj is None:
        return fused_moe.relu2_moe_torch(x, weights, ids, up_proj, down_proj, linear)
    return fused_moe.fused_moe_torch(x, weights, ids, gate_proj, up_proj, down_proj, linear, activation, swiglu_limit)


def causal_conv_scan(
    x: torch.Tensor, history_pool: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: ScanRows
) -> torch.Tensor:
    """A recurrent layer's depthwise causal conv over a step's sequences (recurrent_scan.py): [T, C] float32."""
    if backend(x, history_pool) == "triton" and conv_triton.supports(weight):
        return conv_triton.causal_conv_scan(x, history_pool, weight, bias, scan_meta(rows, x))
    if backend(x, history_pool) == "torch" and cpu_recurrent.conv_supported(x, history_pool, weight, bias):
        return cpu_recurrent.causal_conv_scan(x, history_pool, weight, bias, rows)
    return recurrent_scan.causal_conv_scan(x, history_pool, weight, bias, rows)


def gated_delta_scan(
    state_pool: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    beta: torch.Tensor,
    neg_a: torch.Tensor,
    dt_bias: torch.Tensor,
    rows: ScanRows,
) -> torch.Tensor:
    """Gated DeltaNet's recurrence over a step's sequences (recurrent_scan.py): o [T, Hv, Dv] float32."""
    if backend(state_pool, q) == "triton":
        return delta_triton.gated_delta_scan(state_pool, q, k, v, a, beta, neg_a, dt_bias, scan_meta(rows, q))
    args = (q, k, v, a, beta, neg_a, dt_bias)
    if backend(state_pool, q) == "torch" and cpu_recurrent.gated_delta_supported(state_pool, *args):
        return cpu_recurrent.gated_delta_scan(state_pool, *args, rows)
    return recurrent_scan.gated_delta_scan(state_pool, q, k, v, a, beta, neg_a, dt_bias, rows)


def kda_scan(
    state_pool: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    rows: ScanRows,
) -> torch.Tensor:
    """Kimi delta attention's recurrence over a step's sequences (recurrent_scan.py): o [T, H, Dv] float32."""
    if backend(state_pool, q) == "triton":
        return kda_triton.kda_scan(state_pool, q, k, v, g, beta, scan_meta(rows, q))
    args = (q, k, v, g, beta)
    if backend(state_pool, q) == "torch" and cpu_recurrent.kda_supported(state_pool, *args):
        return cpu_recurrent.kda_scan(state_pool, *args, rows)
    return recurrent_scan.kda_scan(state_pool, q, k, v, g, beta, rows)


def mamba2_scan(
    state_pool: torch.Tensor,
    x: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    a: torch.Tensor,
    d: torch.Tensor,
    time_step_limit: tuple[float, float],
    rows: ScanRows,
) -> torch.Tensor:
    """Mamba2's selective state update over a step's sequences (recurrent_scan.py): y [T, H, P] float32."""
    if backend(state_pool, x) == "triton":
        meta = scan_meta(rows, x)
        return mamba2_triton.mamba2_scan(state_pool, x, b, c, dt, dt_bias, a, d, time_step_limit, meta)
    args = (x, b, c, dt, dt_bias, a, d)
    if backend(state_pool, x) == "torch" and cpu_recurrent.mamba2_supported(state_pool, *args):
        return cpu_recurrent.mamba2_scan(state_pool, *args, time_step_limit, rows)
    return recurrent_scan.mamba2_scan(state_pool, x, b, c, dt, dt_bias, a, d, time_step_limit, rows)

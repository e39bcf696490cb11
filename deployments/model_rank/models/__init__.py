"""Model loading: `load_model(checkpoint_dir, dtype, device, parallel) -> CausalLM` for each supported
`model_type`; every checkpoint problem is a `CheckpointError` naming the file."""

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from deployments.gguf_files.tensors import GgufFiles
from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.fp8_kept import keep_fp8_projections
from deployments.model_rank.fp8_weights import Fp8Files, Fp8Scheme, fp8_scheme
from deployments.model_rank.layers.packing import mark_block_params, pack_projections
from deployments.model_rank.models.base import CausalLM, ModelInfo, id_list
from deployments.model_rank.models.gemma4 import Gemma4Config, Gemma4ForCausalLM
from deployments.model_rank.models.glm4_moe import Glm4MoeConfig, Glm4MoeForCausalLM
from deployments.model_rank.models.glm4_moe_lite import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM
from deployments.model_rank.models.glm5_next import Glm5NextConfig, Glm5NextForCausalLM
from deployments.model_rank.models.glm_moe_dsa import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from deployments.model_rank.models.llama import LlamaConfig, LlamaForCausalLM
from deployments.model_rank.models.nemotron_h import NemotronHConfig, NemotronHForCausalLM
from deployments.model_rank.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from deployments.model_rank.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5MoeConfig
from deployments.model_rank.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from deployments.model_rank.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
from deployments.model_rank.weights import (
    CONFIG_FILE,
    CheckpointFiles,
    load_weights,
    open_files,
    read_config,
    read_generation_config,
    resolve_dtype,
)
from deployments.tokenizer import CheckpointError
from kernels import quant_gemm

__all__ = ["CausalLM", "ModelInfo", "SUPPORTED_MODEL_TYPES", "check_checkpoint", "load_model"]

ARCHITECTURES: dict[str, tuple[type, type[CausalLM]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM),
    "glm4_moe_lite": (Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM),
    # MLA with DeepSeek sparse attention: an indexer picks each query's keys.
    "glm_moe_dsa": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM),
    # Sliding-window and full attention layers, shared KV, per-layer inputs.
    "gemma4_text": (Gemma4Config, Gemma4ForCausalLM),
    "gemma4": (Gemma4Config, Gemma4ForCausalLM),  # the text model of the image-text checkpoint
    # Hybrids: Gated DeltaNet layers beside attention, with per-sequence state slots.
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
    "qwen3_5": (Qwen3_5Config, Qwen3_5ForCausalLM),
    "qwen3_5_text": (Qwen3_5Config, Qwen3_5ForCausalLM),
    "qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3_5ForCausalLM),
    "qwen3_5_moe_text": (Qwen3_5MoeConfig, Qwen3_5ForCausalLM),
    # Kimi delta attention layers beside sparse MLA, over hyper-connection streams.
    "glm5_next": (Glm5NextConfig, Glm5NextForCausalLM),
    # Mamba2 layers beside attention, MLP and MoE blocks.
    "nemotron_h": (NemotronHConfig, NemotronHForCausalLM),
}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)


@contextmanager
def _building_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly on `device` in `dtype` (no float32 staging copy)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(previous)


def check_checkpoint(checkpoint_dir: str | Path) -> str:
    """Refuse a checkpoint this server cannot serve before anything starts (its config's model_type and
    keys, its weights files' headers): one `CheckpointError` naming the problem. Returns the model_type."""
    return _read_checkpoint(Path(checkpoint_dir))[0]


def _read_checkpoint(directory: Path) -> tuple[str, Any, CheckpointFiles | GgufFiles, Fp8Scheme | None]:
    """The model_type, its parsed config, the weights' files and their fp8 scheme, each problem a
    CheckpointError."""
    raw, config_path = read_config(directory), directory / CONFIG_FILE
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise CheckpointError(
            f"{config_path}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    try:
        cfg = ARCHITECTURES[model_type][0].from_hf(raw)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{config_path}: {exc}") from exc
    return model_type, cfg, open_files(directory), fp8_scheme(raw, config_path)


def _with_vision(cfg: Any, vision: bool, config_path: Path) -> Any:
    """The config with its vision tower kept (vision on) or dropped (off: its weights stay unread)."""
    has_tower = getattr(cfg, "vision", None) is not None
    if vision and not has_tower:
        raise CheckpointError(
            f"{config_path}: vision is on, but this checkpoint has no vision tower it can serve "
            "(a qwen3_5 or qwen3_5_moe config with vision_config and image_token_id)"
        )
    if vision and not 0 <= cfg.image_token_id < cfg.vocab_size:  # else every image request is refused
        outside = f"image_token_id ({cfg.image_token_id}) is outside the vocabulary (vocab_size {cfg.vocab_size})"
        raise CheckpointError(f"{config_path}: {outside}")
    return dataclasses.replace(cfg, vision=None) if has_tower and not vision else cfg


def _keeps_blocks(
    files: CheckpointFiles | GgufFiles, dtype: str, device: torch.device, parallel: ParallelContext, pack: bool
) -> bool:
    """A GGUF's quantized weights stay blocks on one CPU rank with the native kernels, unless a float
    `dtype` is asked for (the dequantized reference path); elsewhere they are dequantized at load."""
    return (
        isinstance(files, GgufFiles)
        and dtype == "auto"
        and device.type == "cpu"
        and pack
        and parallel.tp_size == 1
        and quant_gemm.available()
    )


def _load_gguf(
    model_cls: type[CausalLM],
    cfg: Any,
    files: GgufFiles,
    dtype: str,
    device: torch.device,
    parallel: ParallelContext,
    pack: bool,
) -> CausalLM:
    """A GGUF checkpoint folder's model: blocks kept where `_keeps_blocks` allows, else dequantized."""
    keep = _keeps_blocks(files, dtype, device, parallel, pack)
    # Kept blocks feed float32 activations (as llama.cpp computes between its quantized GEMMs: bfloat16's
    # rounding on top of the blocks' moves near-tied replies); dequantized weights compute in bfloat16.
    auto = "float32" if keep else "bfloat16"
    torch_dtype = resolve_dtype(auto if dtype == "auto" else dtype, None, files, files.source)
    with _building_on(device, torch_dtype):
        model = model_cls(cfg, parallel, torch_dtype, files.names())
    if keep:
        mark_block_params(model)
    load_weights(model, files, model.checkpoint_target, keep)
    types = ", ".join(f"{count} {kind}" for kind, count in sorted(files.tensor_types().items()))
    name = str(torch_dtype).removeprefix("torch.")
    model.weights_format = f"gguf ({types}) {'kept quantized' if keep else 'dequantized to ' + name}"
    return model


def _weights_format(dtype: torch.dtype, scheme: Fp8Scheme | None, kept: bool) -> str:
    """What the startup line, /health and /memory say the weights are: a dtype, or an fp8 checkpoint's."""
    name = str(dtype).removeprefix("torch.")
    if scheme is None:
        return name
    blocks = f"fp8 e4m3 ({scheme.block_n}x{scheme.block_k} blocks)"
    return f"{blocks} kept fp8" if kept else f"{blocks} dequantized to {name}"


def load_model(
    checkpoint_dir: str | Path,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    parallel: ParallelContext = ParallelContext(),
    pack: bool = True,
    vision: bool = False,
    keep_fp8: bool | None = None,
) -> CausalLM:
    """Build the checkpoint's architecture for this TP rank and stream its weights in.

    `pack`: lay bf16 projections out for the CPU matmul kernel (off where another backend takes the tensors).
    `vision`: load the checkpoint's vision tower too (a CheckpointError when it has none).
    `keep_fp8`: an fp8 checkpoint's projections stay fp8 for kernels/fp8_matmul.py (default: on CUDA only;
    elsewhere they are dequantized into `dtype`).
    """
    directory = Path(checkpoint_dir)
    model_type, cfg, files, scheme = _read_checkpoint(directory)
    cfg = _with_vision(cfg, vision, directory / CONFIG_FILE)
    config_path, model_cls = directory / CONFIG_FILE, ARCHITECTURES[model_type][1]
    if isinstance(files, GgufFiles):
        model = _load_gguf(model_cls, cfg, files, dtype, torch.device(device), parallel, pack)
    else:
        # An fp8 checkpoint's own tensors say nothing of the model dtype: bfloat16 unless its config names one.
        declared = cfg.dtype or ("bfloat16" if scheme is not None else None)
        torch_dtype = resolve_dtype(dtype, declared, files, config_path)
        with _building_on(torch.device(device), torch_dtype):
            model = model_cls(cfg, parallel, torch_dtype, files.names())
        keep = torch.device(device).type == "cuda" if keep_fp8 is None else keep_fp8
        kept = keep_fp8_projections(model, files, scheme, model.checkpoint_target) if keep and scheme else frozenset()
        load_weights(model, Fp8Files(files, scheme, torch_dtype, kept), model.checkpoint_target)
        model.weights_format = _weights_format(torch_dtype, scheme, bool(kept))
    model.after_load()
    if pack and torch.device(device).type == "cpu":
        # bf16 projections with the native kernels on: packed once for kernels/cpu_gemm (else torch's GEMMs keep them).
        model.packed_weights = pack_projections(model)
    extra_eos = id_list(read_generation_config(directory).get("eos_token_id"))
    model.config.eos_token_ids += [i for i in extra_eos if i not in model.config.eos_token_ids]
    return model.eval()

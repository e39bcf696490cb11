"""Block-scaled FP8 checkpoints (DeepSeek, Qwen and GLM publish them): the config check, the scale grids, and
the tensor stream that dequantizes each projection at load or passes it on FP8 (for fp8_kept.py's weights).

A quantized projection is `X.weight` (float8_e4m3fn, [N, K]) beside `X.weight_scale_inv` (float32,
[ceil(N / bn), ceil(K / bk)]): the real weight is the FP8 value times the scale of its bn x bk block
(docs/checkpoints.md). Every problem is a `CheckpointError` naming the config key or the tensor.
"""

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from deployments.tokenizer import CheckpointError

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPE = torch.float8_e4m3fn
# A projection's weight: the last module name holds "proj" (q_proj, kv_a_proj_with_mqa, in_proj_qkvz, ...).
PROJECTION_RE = re.compile(r"(^|\.)[A-Za-z0-9_]*proj[A-Za-z0-9_]*\.weight$")
KNOWN_KEYS = (
    "quant_method",
    "fmt",
    "activation_scheme",
    "weight_block_size",
    "modules_to_not_convert",
    "ignored_layers",
)


@dataclass(frozen=True)
class Fp8Scheme:
    """A checkpoint's block-scaled FP8 layout: each scale covers `block_n` rows by `block_k` columns."""

    block_n: int
    block_k: int

    def grid(self, rows: int, cols: int) -> tuple[int, int]:
        """The scale grid's shape for an [rows, cols] weight (partial blocks at the edges count)."""
        return -(-rows // self.block_n), -(-cols // self.block_k)


def fp8_scheme(config: dict[str, Any], config_path: Path) -> Fp8Scheme | None:
    """The config's FP8 scheme (None when it declares no quantization); anything but dynamic block-scaled e4m3
    FP8 is a CheckpointError naming the key and its value."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise CheckpointError(f"{config_path}: quantization_config {quant!r} is not an object")

    def refuse(key: str, why: str) -> CheckpointError:
        return CheckpointError(
            f"{config_path}: quantization_config.{key} = {quant.get(key)!r} is not supported ({why})"
        )

    for key in quant:
        if key not in KNOWN_KEYS:
            raise refuse(key, f"the block-scaled fp8 keys are {', '.join(KNOWN_KEYS)}")
    if quant.get("quant_method") != "fp8":
        raise refuse("quant_method", "only block-scaled 'fp8' checkpoints load")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise refuse("fmt", "fp8 weights must be 'e4m3'")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise refuse("activation_scheme", "only 'dynamic' activations: static input scales are not read")
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise refuse("weight_block_size", "expected two positive integers, [rows, columns]")
    for key in ("modules_to_not_convert", "ignored_layers"):
        listed = quant.get(key)
        if listed is not None and not (isinstance(listed, list) and all(isinstance(m, str) for m in listed)):
            raise refuse(key, "expected a list of module names")
    return Fp8Scheme(block_n=block[0], block_k=block[1])


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, scheme: Fp8Scheme) -> torch.Tensor:
    """float32(weight) * the scale of each element's block: [N, K] float32."""
    rows, cols = weight.shape
    scales = scale_inv.float().repeat_interleave(scheme.block_n, 0)[:rows].repeat_interleave(scheme.block_k, 1)
    return weight.float() * scales[:, :cols]


def row_scales(scale_inv: torch.Tensor, rows: int, scheme: Fp8Scheme) -> torch.Tensor:
    """The scale grid repeated per weight row, [N, ceil(K / bk)] float32: what kernels/fp8_matmul.py reads.
    Per-row, a tensor-parallel shard of rows (or of whole column blocks) cuts it as it cuts the weight."""
    return scale_inv.float().repeat_interleave(scheme.block_n, 0)[:rows].contiguous()


class TensorSource(Protocol):
    """What this module reads of weights.CheckpointFiles (imported from there would be a cycle)."""

    source: Path
    weight_map: dict[str, Path]

    def tensors(self) -> Iterator[tuple[str, Path, torch.Tensor]]: ...


def read_scales(files: TensorSource) -> dict[str, torch.Tensor]:
    """Every `*_scale_inv` tensor by name (small: one float per block), read before the weights stream so
    that a weight meets its scale whichever shard holds either."""
    names = sorted(name for name in files.weight_map if name.endswith(SCALE_SUFFIX))
    scales: dict[str, torch.Tensor] = {}
    for path in sorted({files.weight_map[name] for name in names}):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                scales.update((name, handle.get_tensor(name)) for name in names if files.weight_map[name] == path)
        except Exception as exc:  # a missing tensor or a corrupt file, in safetensors' own error types
            raise CheckpointError(f"{path}: scale tensors unreadable ({exc})") from exc
    return scales


class Fp8Files:
    """A checkpoint's files whose tensor stream turns each FP8 projection into the model dtype, or, for the
    names in `kept`, passes it on FP8 with its per-row scales attached (`tensor.fp8_scales`)."""

    def __init__(self, files: TensorSource, scheme: Fp8Scheme | None, dtype: torch.dtype, kept: frozenset[str]):
        self.files, self.scheme, self.dtype, self.kept = files, scheme, dtype, kept
        self.source, self.weight_map = files.source, files.weight_map

    def tensors(self) -> Iterator[tuple[str, Path, torch.Tensor]]:
        scales = read_scales(self.files) if self.scheme is not None else {}
        for name, path, tensor in self.files.tensors():
            if name.endswith(SCALE_SUFFIX) and self.scheme is not None:
                if name.removesuffix(SCALE_SUFFIX) not in self.weight_map:
                    raise CheckpointError(f"{path}: tensor {name!r} scales no tensor of this checkpoint")
                continue
            if tensor.dtype.is_floating_point and tensor.element_size() == 1:
                tensor = self._converted(name, path, tensor, scales)
            yield name, path, tensor

    def _converted(self, name: str, path: Path, weight: torch.Tensor, scales: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.scheme is None:
            raise CheckpointError(f"{path}: tensor {name!r} is {weight.dtype}, but config.json declares no fp8 scheme")
        if weight.dtype != FP8_DTYPE:
            raise CheckpointError(f"{path}: tensor {name!r} is {weight.dtype}; fp8 weights must be e4m3")
        if weight.dim() != 2 or not PROJECTION_RE.search(name):
            raise CheckpointError(f"{path}: tensor {name!r} is fp8 but not a projection's [N, K] weight")
        scale = scales.get(name + SCALE_SUFFIX)
        if scale is None:
            raise CheckpointError(f"{path}: fp8 tensor {name!r} has no {name + SCALE_SUFFIX!r} beside it")
        expected = self.scheme.grid(*weight.shape)
        if tuple(scale.shape) != expected:
            raise CheckpointError(
                f"{path}: tensor {name + SCALE_SUFFIX!r} has shape {tuple(scale.shape)}; the blocks of {name!r} "
                f"{tuple(weight.shape)} need {expected}"
            )
        if name in self.kept:
            weight.fp8_scales = row_scales(scale, weight.shape[0], self.scheme)
            return weight
        return dequantize(weight, scale, self.scheme).to(self.dtype)

"""Reading a Hugging Face checkpoint directory: config, dtype choice, and streaming safetensors into params.

Each parameter carries a `weight_loader(param, tensor[, expert_id])` set by its layer, which checks the
full checkpoint shape and copies this rank's tensor-parallel slice. Every problem is a `CheckpointError`
naming the file at fault.
"""

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from deployments.gguf_files.tensors import GgufFiles, QuantBlocks
from deployments.model_rank.fp8_weights import fp8_scheme
from deployments.model_rank.layers.quantized import put_blocks, takes_blocks
from deployments.tokenizer import CheckpointError

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
EXPERT_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
FUSED_GATE_UP_RE = re.compile(r"^(?P<prefix>.*\.experts)\.gate_up_proj$")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc})") from exc


def read_config(checkpoint_dir: Path) -> dict[str, Any]:
    path = checkpoint_dir / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (a checkpoint directory needs config.json)")
    config = _read_json(path)
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    fp8_scheme(config, path)  # refuses any quantization but block-scaled fp8 (fp8_weights.py)
    return config


def read_generation_config(checkpoint_dir: Path) -> dict[str, Any]:
    """generation_config.json if present (it often lists extra end tokens)."""
    path = checkpoint_dir / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    data = _read_json(path)
    return data if isinstance(data, dict) else {}


@dataclass
class CheckpointFiles:
    """Where each tensor of a checkpoint lives: one model.safetensors, or shards listed by an index."""

    source: Path  # the single file or the index: what "missing tensor" errors name
    weight_map: dict[str, Path]  # tensor name -> safetensors file

    @classmethod
    def open(cls, checkpoint_dir: Path) -> "CheckpointFiles":
        index, single = checkpoint_dir / INDEX_FILE, checkpoint_dir / SINGLE_FILE
        if index.is_file():
            return cls(index, _read_index(index))
        if single.is_file():
            return cls(single, {name: single for name in _file_keys(single)})
        raise CheckpointError(f"{checkpoint_dir}: no {SINGLE_FILE} or {INDEX_FILE}")

    def names(self) -> frozenset[str]:
        return frozenset(self.weight_map)

    def files(self) -> list[Path]:
        return sorted(set(self.weight_map.values()))

    def tensors(self) -> Iterator[tuple[str, Path, torch.Tensor]]:
        """(name, file, tensor) for every tensor, one file open at a time."""
        for path in self.files():
            wanted = sorted(name for name, file in self.weight_map.items() if file == path)
            try:
                with safe_open(str(path), framework="pt", device="cpu") as handle:
                    present = set(handle.keys())
                    for name in wanted:
                        if name not in present:
                            raise CheckpointError(f"{path}: lacks tensor {name!r} that {self.source.name} places there")
                        yield name, path, handle.get_tensor(name)
            except CheckpointError:
                raise
            except Exception as exc:  # safetensors raises its own error types for corrupt files
                raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from exc

    def first_float_dtype(self) -> torch.dtype | None:
        """The dtype of the first floating tensor, read from a header without loading data."""
        for path in self.files():
            try:
                with safe_open(str(path), framework="pt", device="cpu") as handle:
                    kinds = [handle.get_slice(name).get_dtype() for name in handle.keys()]
            except Exception as exc:  # corrupt header, truncated file
                raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from exc
            for kind in kinds:
                if kind in SAFETENSORS_DTYPES:
                    return SAFETENSORS_DTYPES[kind]
        return None


def open_files(checkpoint_dir: Path) -> "CheckpointFiles | GgufFiles":
    """A folder's weights: its GGUF files where it links them (deployments/gguf_files), else safetensors."""
    return GgufFiles.open(checkpoint_dir) or CheckpointFiles.open(checkpoint_dir)


def _file_keys(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            return list(handle.keys())
    except Exception as exc:  # corrupt header, truncated file
        raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from exc


def _read_index(index: Path) -> dict[str, Path]:
    data = _read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f'{index}: needs a non-empty "weight_map" object')
    resolved: dict[str, Path] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file:
            raise CheckpointError(f"{index}: tensor {name!r} maps to {file!r}, not a file name in the directory")
        path = index.parent / file
        if not path.is_file():
            raise CheckpointError(f"{index}: shard {file} (holding {name!r}) does not exist")
        resolved[name] = path
    return resolved


def resolve_dtype(choice: str, declared: str | None, files: CheckpointFiles, config_path: Path) -> torch.dtype:
    """'auto' takes the config's declared dtype (`dtype` / legacy `torch_dtype`), else the tensors' own."""
    if choice != "auto":
        if choice not in DTYPES:
            raise ValueError(f"dtype {choice!r} is not one of auto, bfloat16, float16, float32")
        return DTYPES[choice]
    if declared is not None:
        if declared not in DTYPES:
            raise CheckpointError(f"{config_path}: dtype {declared!r} is not supported (bfloat16, float16, float32)")
        return DTYPES[declared]
    return files.first_float_dtype() or torch.float32


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: a parameter, one expert's slice of it, or a fused gate/up pair."""

    param: str
    expert_id: int | None = None
    fused_gate_up: bool = False  # transformers' `experts.gate_up_proj`: param names the gate half


def expert_target(name: str) -> WeightTarget | None:
    """Per-expert hub names and transformers' fused layout, mapped onto stacked expert params."""
    match = EXPERT_RE.match(name)
    if match:
        return WeightTarget(f"{match['prefix']}.{match['proj']}", expert_id=int(match["expert"]))
    match = FUSED_GATE_UP_RE.match(name)
    if match:
        return WeightTarget(f"{match['prefix']}.gate_proj", fused_gate_up=True)
    return None


class _Progress:
    """Which parameters (and which experts of stacked ones) have been filled."""

    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        self.params = params
        self.done: dict[str, set[int]] = {}

    def mark(self, param: str, expert_id: int | None) -> None:
        count = getattr(self.params[param], "expert_count", 1)
        ids = set(range(count)) if expert_id is None else {expert_id}
        self.done.setdefault(param, set()).update(ids)

    def missing(self) -> list[str]:
        out = []
        for name, param in self.params.items():
            want = set(range(getattr(param, "expert_count", 1)))
            lacking = want - self.done.get(name, set())
            if lacking and hasattr(param, "expert_count"):
                out.append(f"{name} (experts {sorted(lacking)[:8]})")
            elif lacking:
                out.append(name)
        return out


def load_weights(
    module: nn.Module,
    files: "CheckpointFiles | GgufFiles",
    target_of: Callable[[str], WeightTarget | None],
    keep_quantized: bool = False,
) -> None:
    """Stream every checkpoint tensor into `module`; `target_of` maps names (None = ignore the tensor).
    `keep_quantized`: a GGUF's quantized weights go in as their blocks where the parameter takes them."""
    params = dict(module.named_parameters())
    progress = _Progress(params)
    unexpected: dict[Path, list[str]] = {}
    stream = files.tensors(keep_quantized) if isinstance(files, GgufFiles) else files.tensors()
    for name, path, tensor in stream:
        target = target_of(name)
        if target is None:
            continue
        if target.param not in params:
            unexpected.setdefault(path, []).append(name)
            continue
        try:
            _apply(params, target, tensor, progress)
        except (ValueError, IndexError) as exc:
            raise CheckpointError(f"{path}: tensor {name!r}: {exc}") from exc
    if unexpected:
        path, names = next(iter(unexpected.items()))
        raise CheckpointError(f"{path}: unexpected tensors {names[:8]} (not part of this model)")
    missing = progress.missing()
    if missing:
        raise CheckpointError(f"{files.source}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def _apply(
    params: dict[str, nn.Parameter], target: WeightTarget, tensor: "torch.Tensor | QuantBlocks", progress: _Progress
) -> None:
    param = params[target.param]
    if isinstance(tensor, QuantBlocks):
        if takes_blocks(param) and not target.fused_gate_up:
            put_blocks(param, tensor.data, tensor.qtype, tensor.shape, target.expert_id)
            progress.mark(target.param, target.expert_id)
            return
        tensor = tensor.dequantized()
    if target.fused_gate_up:
        up_name = target.param.rsplit(".", 1)[0] + ".up_proj"
        if tensor.dim() != 3 or tensor.shape[1] % 2:
            raise ValueError(f"shape {tuple(tensor.shape)} is not a fused [experts, 2 * intermediate, hidden]")
        gate, up = tensor.chunk(2, dim=1)
        param.weight_loader(param, gate)
        params[up_name].weight_loader(params[up_name], up)
        progress.mark(target.param, None)
        progress.mark(up_name, None)
        return
    if target.expert_id is not None:
        if target.expert_id >= getattr(param, "expert_count", 0):
            raise ValueError(f"expert {target.expert_id} is beyond the configured expert count")
        param.weight_loader(param, tensor, target.expert_id)
    else:
        param.weight_loader(param, tensor)
    progress.mark(target.param, target.expert_id)

"""The tensors of a GGUF checkpoint folder, streamed under their Hugging Face names.

Each tensor comes dequantized to float32 with gguf-py's own dequantizers (the reference path, what
transformers' `gguf_file=` loading computes), or, where the loader keeps weights quantized, as its raw blocks
(`QuantBlocks`): the bytes the file stores, memory-mapped, never expanded (docs/gguf.md).
"""

import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from deployments.gguf_files.names import ARCHITECTURES, expert_names, hf_name, permuted_heads
from deployments.tokenizer import CheckpointError
from kernels import quant_gemm

KEPT_TYPES = frozenset(quant_gemm.QUANT_TYPES)  # the block types the CPU kernels multiply
# What gguf-py dequantizes (the reference path); a file holding any other type is refused at startup.
READ_TYPES = KEPT_TYPES | frozenset(
    "F32 F16 BF16 Q5_0 Q5_1 Q2_K Q3_K IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ4_NL IQ4_XS MXFP4".split()
)


@dataclass(frozen=True)
class QuantBlocks:
    """One quantized weight as the file stores it: rows of raw blocks, uint8 [N, row_bytes]."""

    data: torch.Tensor
    qtype: str  # the GGUF type name, e.g. "Q4_K"
    shape: tuple[int, int]  # the dequantized [N, K]

    def dequantized(self) -> torch.Tensor:
        """float32 [N, K], as gguf-py dequantizes the same bytes."""
        from gguf import GGMLQuantizationType, dequantize

        return _tensor(dequantize(self.data.numpy(), GGMLQuantizationType[self.qtype]))


class GgufFiles:
    """The GGUF files of a checkpoint folder; the interface of weights.CheckpointFiles."""

    def __init__(self, folder: Path, shards: list[Path]) -> None:
        from gguf import GGUFReader

        config = json.loads((folder / "config.json").read_text())
        self.source = shards[0]
        self.heads = (config.get("num_attention_heads", 0), config.get("num_key_value_heads", 0))
        try:
            self.readers = [(path, GGUFReader(path)) for path in shards]
        except Exception as exc:  # not GGUF bytes, truncated
            raise CheckpointError(f"{shards[0]}: not a readable GGUF file ({exc})") from exc
        self.arch = str(self.readers[0][1].fields["general.architecture"].contents())
        if self.arch not in ARCHITECTURES:
            raise CheckpointError(f"{self.source}: GGUF architecture {self.arch!r} is not served")
        unread = sorted(set(self.tensor_types()) - READ_TYPES)
        if unread:
            raise CheckpointError(
                f"{self.source}: tensor type {unread[0]} is not read (read: {', '.join(sorted(READ_TYPES))})"
            )

    @classmethod
    def open(cls, folder: Path) -> "GgufFiles | None":
        shards = sorted(folder.glob("*.gguf"))
        return cls(folder, shards) if shards else None

    def names(self) -> frozenset[str]:
        out: set[str] = set()
        for _, reader in self.readers:
            for tensor in reader.tensors:
                out.update(self._names(tensor.name, tensor.data.shape))
        return frozenset(out)

    def files(self) -> list[Path]:
        return [path for path, _ in self.readers]

    def first_float_dtype(self) -> torch.dtype | None:
        return None  # a GGUF's weights have no one float dtype: `auto` is decided by the loader

    def tensor_types(self) -> dict[str, int]:
        """How many tensors of each GGUF type the files hold (what /health and the startup line report)."""
        counts: dict[str, int] = {}
        for _, reader in self.readers:
            for tensor in reader.tensors:
                counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
        return counts

    def tensors(self, keep_quantized: bool = False) -> Iterator[tuple[str, Path, "torch.Tensor | QuantBlocks"]]:
        """(Hugging Face name, file, tensor) for each tensor; stacked experts come one expert at a time."""
        for path, reader in self.readers:
            for tensor in reader.tensors:
                names = self._names(tensor.name, tensor.data.shape)
                if not names:
                    continue
                value = self._value(tensor, keep_quantized)
                if len(names) == 1:
                    yield names[0], path, value
                    continue
                for expert, name in enumerate(names):
                    yield name, path, _expert(value, expert)

    def _names(self, gguf_name: str, shape: tuple[int, ...]) -> list[str]:
        experts = expert_names(gguf_name, shape[0] if len(shape) == 3 else 0)
        if experts is not None:
            return experts
        try:
            name = hf_name(gguf_name)
        except KeyError:
            raise CheckpointError(f"{self.source}: tensor {gguf_name!r} is not part of a {self.arch} model") from None
        return [] if name is None else [name]

    def _value(self, tensor, keep_quantized: bool) -> "torch.Tensor | QuantBlocks":
        from gguf import dequantize

        kind = tensor.tensor_type.name
        heads = permuted_heads(self.arch, tensor.name, *self.heads)
        if keep_quantized and kind in KEPT_TYPES and tensor.data.ndim in (2, 3):
            rows = _unpermute(np.asarray(tensor.data), heads)
            shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists dimensions innermost first
            return QuantBlocks(_tensor(rows), kind, shape)
        return _tensor(_unpermute(dequantize(tensor.data, tensor.tensor_type), heads))


def _tensor(values: np.ndarray) -> torch.Tensor:
    """A tensor over `values`, which may be the file's read-only memory map: nothing ever writes to them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(values))


def _unpermute(rows: np.ndarray, heads: int | None) -> np.ndarray:
    """Undo the converter's rotary interleave of q/k rows (rows are independent, so raw blocks permute too)."""
    if heads is None:
        return rows
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _expert(value: "torch.Tensor | QuantBlocks", expert: int) -> "torch.Tensor | QuantBlocks":
    if isinstance(value, QuantBlocks):
        return QuantBlocks(value.data[expert], value.qtype, value.shape)
    return value[expert]

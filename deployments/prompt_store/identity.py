"""Which set a Scheduler's states belong to: the checkpoint's identity (its weights and config, not its
name), dtype, KV layout, tensor-parallel shape and kernel build. States written under one identity are
never read under another, so a checkpoint changed under the same name starts a new set.
"""

import hashlib
import json
import platform
from pathlib import Path

import torch

SAMPLE_BYTES = 1 << 20  # of each weights file: its first and last MiB, and one MiB every 256 MiB between
SAMPLE_STRIDE = 256 << 20


def _file_digest(path: Path) -> bytes:
    """Size, safetensors header and sampled bytes: hashing every byte of a large checkpoint at every start
    would cost minutes, and any retraining or re-quantisation changes the sampled bytes."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}".encode())
    with path.open("rb") as handle:
        offsets = sorted({0, max(0, size - SAMPLE_BYTES), *range(SAMPLE_STRIDE, size, SAMPLE_STRIDE)})
        for offset in offsets:
            handle.seek(offset)
            digest.update(handle.read(SAMPLE_BYTES))
    return digest.digest()


def checkpoint_identity(model_dir: str) -> str:
    folder = Path(model_dir)
    digest = hashlib.sha256()
    config = json.loads((folder / "config.json").read_text())
    digest.update(json.dumps(config, sort_keys=True).encode())
    for weights in sorted([*folder.glob("*.safetensors"), *folder.glob("*.gguf")]):
        digest.update(_file_digest(weights))
    return digest.hexdigest()[:24]


def kernel_build(device: str) -> str:
    """torch's version, the kernels that compute on `device` (they decide the bits) and the machine: on a
    GPU its name, Triton's version and the projections' matmul; on the CPU the native kernels' sources."""
    if device.startswith("cuda"):
        import triton

        return f"torch{torch.__version__}-{device}-triton{triton.__version__}-{platform.machine()}"
    from kernels import cpu_native, cpu_recurrent

    native = cpu_native.source_digest() if cpu_native.available() else "torch-kernels"
    recurrent = cpu_recurrent.source_digest() if cpu_recurrent.available() else "torch-recurrence"
    return f"torch{torch.__version__}-{native}-{recurrent}-{platform.machine()}"


CONVERSATIONS, PREFIXES = "conversations", "prefixes"  # --learn-conversations' store, --learn's


def set_id(
    model_dir: str, dtype: str, kv_layout: str, tensor_parallel_size: int, device: str, kind: str = CONVERSATIONS
) -> str:
    """The set's folder name: readable prefix, a hash of everything that decides the stored bits, and the
    kind of store (a --learn-conversations server never reads or writes a plain --learn one's prefixes).
    `device`: where the ranks compute ("cpu", or "cuda:<GPU name>:<matmul>"): states computed on a GPU are
    never restored into a CPU server's cache, nor the other way round."""
    parts = [checkpoint_identity(model_dir), dtype, kv_layout, f"tp{tensor_parallel_size}", kernel_build(device)]
    tag = hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]
    return f"{Path(model_dir).name[:40]}-{dtype}-{tag}-{kind}"

"""A GGUF file (or a `-00001-of-0000N.gguf` split set) opened as a checkpoint folder.

The folder holds what every other part of the server reads from a checkpoint -- config.json, the tokenizer
files and the chat template, derived from the file's metadata with transformers' GGUF readers -- and links to
the GGUF files themselves, whose tensors the ranks read in place (deployments/gguf_files/tensors.py). It is
written once per file version under the cache root and reused (docs/gguf.md).
"""

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from deployments.gguf_files.names import ARCHITECTURES
from deployments.tokenizer import CheckpointError

SHARD = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
FOLDER_VERSION = "1"  # bump when what the folder holds changes: older folders are then derived again
COMPLETE = ".complete"
# Keys transformers' GGUF tables skip, where the family's defaults then stand in (Qwen3's head_dim 128):
# read from the file as llama.cpp reads them.
SKIPPED_BY_TRANSFORMERS = {"attention.key_length": "head_dim", "expert_feed_forward_length": "moe_intermediate_size"}


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf" and path.is_file()


def shard_files(path: Path) -> list[Path]:
    """Every file of the set `path` belongs to, in order (one file when it is not a split set)."""
    match = SHARD.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    files = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{path}: split set of {count} files lacks {', '.join(missing)}")
    return files


def cache_root() -> Path:
    return Path(os.environ.get("TENSORFOLD_GGUF_CACHE", Path.home() / ".cache" / "tensorfold" / "gguf"))


def checkpoint_folder(path: Path) -> Path:
    """The checkpoint folder of GGUF file `path`, derived on first use. CheckpointError names what is wrong."""
    files = shard_files(path.resolve())
    match = SHARD.match(files[0].name)
    stem = match["stem"] if match else files[0].stem
    folder = cache_root() / _version_key(files) / stem
    if (folder / COMPLETE).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=folder.parent))
    try:
        _derive(files, staging)
        (staging / COMPLETE).write_text(json.dumps([str(f) for f in files]))
        try:
            staging.rename(folder)
        except OSError:  # another process derived it first; theirs is the same
            if not (folder / COMPLETE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _version_key(files: list[Path]) -> str:
    digest = hashlib.sha256(FOLDER_VERSION.encode())
    for file in files:
        stat = file.stat()
        digest.update(f"{file}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def _derive(files: list[Path], out: Path) -> None:
    first = files[0]
    (architecture,) = _fields(first, ("general.architecture",))
    if not isinstance(architecture, str):
        raise CheckpointError(f"{first}: not a GGUF file with general.architecture")
    if architecture not in ARCHITECTURES:
        raise CheckpointError(
            f"{first}: GGUF architecture {architecture!r} is not served (served: {', '.join(ARCHITECTURES)})"
        )
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(first.parent, gguf_file=first.name)
        tokenizer = AutoTokenizer.from_pretrained(first.parent, gguf_file=first.name)
    except Exception as exc:  # transformers raises many kinds for a malformed file
        raise CheckpointError(f"{first}: unreadable GGUF metadata ({exc})") from exc
    keys = (f"{architecture}.{key}" for key in SKIPPED_BY_TRANSFORMERS)
    end_of_turn, *values = _fields(first, ("tokenizer.ggml.eot_token_id", *keys))
    for attribute, value in zip(SKIPPED_BY_TRANSFORMERS.values(), values):
        if isinstance(value, int):
            setattr(config, attribute, value)
    # transformers looks for the output head in the first file only; in a split set it may sit in another.
    config.tie_word_embeddings = not any("output.weight" in _tensor_names(file) for file in files)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    end_ids = [i for i in (config.eos_token_id, end_of_turn) if isinstance(i, int)]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(set(end_ids))}))
    for file in files:
        (out / file.name).symlink_to(file)


def _tensor_names(path: Path) -> set[str]:
    from gguf import GGUFReader

    return {tensor.name for tensor in GGUFReader(path).tensors}


def _fields(path: Path, keys: tuple[str, ...]) -> list[object]:
    from gguf import GGUFReader

    try:
        fields = GGUFReader(path).fields
    except Exception as exc:  # gguf raises ValueError and struct errors for non-GGUF bytes
        raise CheckpointError(f"{path}: not a readable GGUF file ({exc})") from exc
    return [fields[key].contents() if key in fields else None for key in keys]

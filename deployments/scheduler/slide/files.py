"""The pocket's files (docs/slide.md, Files): `pocket.safetensors` and `graph.json` in a folder per checkpoint
identity and dtype, owner-only, each written whole through a temp file and a rename (as the prompt store)."""

import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from safetensors.numpy import load, save

from deployments.messages.slide import SlideFact, SlideQuestion
from deployments.prompt_store.files import read_file, remove_temp_files, secure_dir, write_file_atomically
from deployments.prompt_store.identity import checkpoint_identity
from deployments.scheduler.slide.host_pocket import HostPocket

POCKET_FILE, GRAPH_FILE = "pocket.safetensors", "graph.json"


def pocket_folder(slide_dir: str, model_dir: str, dtype: str) -> Path:
    """The folder of one checkpoint's pocket: a pocket fits the weights (and dtype) it was trained with."""
    name = f"{Path(model_dir).name[:40]}-{dtype}-{checkpoint_identity(model_dir)}"
    return Path(slide_dir).expanduser() / name


class PocketFiles:
    """Reads and writes one folder's pocket and graph."""

    def __init__(self, folder: Path) -> None:
        self.folder = secure_dir(folder)
        remove_temp_files(self.folder)

    def write_pocket(self, pocket: HostPocket, version: int) -> None:
        tensors = {"gate": pocket.gate, "bias": pocket.bias, "down": pocket.down}
        write_file_atomically(self.folder / POCKET_FILE, save(tensors, metadata={"version": str(version)}))

    def read_pocket(self) -> tuple[HostPocket, int] | None:
        path = self.folder / POCKET_FILE
        if not path.exists():
            return None
        data = read_file(path)
        tensors = load(data)
        header_len = int.from_bytes(data[:8], "little")
        version = int(json.loads(data[8 : 8 + header_len]).get("__metadata__", {}).get("version", "0"))
        pocket = HostPocket(*(np.ascontiguousarray(tensors[k], dtype=np.float32) for k in ("gate", "bias", "down")))
        return pocket, version

    def write_graph(self, facts: list[SlideFact], version: int, next_id: int) -> None:
        body = {"version": version, "next_id": next_id, "written": time.time(), "facts": [asdict(f) for f in facts]}
        write_file_atomically(self.folder / GRAPH_FILE, json.dumps(body, indent=1).encode())

    def read_graph(self) -> tuple[list[SlideFact], int, int] | None:
        """(facts, the version the graph was written at, the next fact id), or None when there is no graph."""
        path = self.folder / GRAPH_FILE
        if not path.exists():
            return None
        body = json.loads(read_file(path))
        facts = [_fact(raw) for raw in body["facts"]]
        return facts, int(body["version"]), int(body["next_id"])


def _fact(raw: dict) -> SlideFact:
    questions = [SlideQuestion(**q) for q in raw.pop("questions")]
    return SlideFact(questions=questions, **raw)

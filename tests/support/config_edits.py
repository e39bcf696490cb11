"""A tiny checkpoint with its config.json edited: what the config-key tests serve or refuse."""

import json
from collections.abc import Callable
from pathlib import Path


def with_config(source: Path, out: Path, edit: Callable[[dict], object]) -> Path:
    """`out`: `source` with `edit` applied to its config.json in place (the other files linked, not copied)."""
    out.mkdir()
    for item in source.iterdir():
        if item.name != "config.json":
            (out / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    return out

"""`python -m kernels.gpu_check` end to end on CPU: its engine phase (the offline engine's `generate` on the tiny
checkpoint, against transformers) in processes where ray, fastapi, starlette and xgrammar are not installed,
as on a GPU machine set up for the engine alone (docs/benchmarks.md, The GPU check)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Every process started with this folder on PYTHONPATH (the check and the engine phase it starts) finds none
# of the hidden packages, as if they were not installed, and notes its command line in $HIDDEN_LOG.
NOT_INSTALLED = """
import os
import sys

HIDDEN = {"ray", "fastapi", "starlette", "xgrammar"}


class NotInstalled:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        find = getattr(self.finder, "find_spec", None)
        if name.partition(".")[0] in HIDDEN or find is None:
            return None
        return find(name, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = [NotInstalled(finder) for finder in sys.meta_path]
with open(os.environ["HIDDEN_LOG"], "a") as log:
    log.write(" ".join(sys.orig_argv) + "\\n")
"""


def test_the_engine_phase_passes_on_cpu_where_ray_fastapi_starlette_and_xgrammar_cannot_be_imported(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "sitecustomize.py").write_text(NOT_INSTALLED)
    log = tmp_path / "processes.txt"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "HIDDEN_LOG": str(log)}
    probe = [sys.executable, "-c", "import importlib.util as u; print([u.find_spec(m) for m in ('ray', 'xgrammar')])"]
    assert subprocess.run(probe, env=env, capture_output=True, text=True).stdout.strip() == "[None, None]"

    command = [sys.executable, "-m", "kernels.gpu_check", "--dry-run", "--skip-kernels"]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, output
    summary = [line for line in proc.stdout.splitlines() if line.startswith("engine check")]
    assert len(summary) == 1 and summary[0].startswith("engine check PASS"), output
    assert "alone = batched with 15: greedy 8/8, sampled 8/8" in summary[0]
    assert "first greedy tokens as transformers': float32 16/16" in summary[0]
    assert "serve_app.bench.gpu_engine --size tiny --device cpu" in log.read_text()  # the engine ran hidden from them

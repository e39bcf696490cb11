"""Every kernel compiles for sm_90 (ahead of time, no GPU needed): `TENSORFOLD_COMPILE_CHECK=1` to run.

Opt-in because compiling takes one to two minutes on two cores; the interpreter tests cannot catch
compile-only errors (types of loop-carried values, dot sizes, shared memory), so run it after editing a
kernel when no GPU is at hand. `python -m kernels.compile_check --arch 80,90` checks every shape.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    os.environ.get("TENSORFOLD_COMPILE_CHECK") != "1", reason="set TENSORFOLD_COMPILE_CHECK=1 (takes 1-2 min)"
)
def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    command = [sys.executable, "-m", "kernels.compile_check", "--quick", "--arch", "90", "--dtypes", "bfloat16,float32"]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

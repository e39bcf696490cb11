"""lm-eval-harness's `local-completions` loglikelihood against the real graph (configs/glm.yaml, tiny-glm).

lm-eval itself runs, offline: docs/agents/lm-eval.md's command scores the local multiple-choice task in
tests/e2e/lm_eval_task, each choice one /v1/completions request with echo, logprobs 1 and max_tokens 1 (the
continuation's rows are the echoed prompt's; lm-eval drops the last row, the reply's). Every loglikelihood it
wrote must equal transformers' on the same float32 checkpoint: the sum of the continuation tokens'
log-softmax given the context, the pair tokenised as lm-eval splits it. Each item's acc and each choice's is_greedy must follow.
It shares the session's tiny-glm app (conftest.glm_base_url) with the other test_e2e_* modules that come
before test_e2e_parallel.py, whose declarative deploy replaces the session's applications.
"""

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from serve_app.args import AppArgs
from tests.conftest import REPO

pytestmark = pytest.mark.e2e
TASK_DIR = Path(__file__).resolve().parent / "lm_eval_task"
TASK = "tensorfold_choice"
TOL = 1e-4  # float32 engine and float32 transformers, both summed in float64
Reference = Callable[[str, str], tuple[float, bool]]  # (context, continuation) -> (loglikelihood, is_greedy)


@pytest.fixture(scope="module")
def model_dir(served_model: str) -> Path:
    return AppArgs(model=served_model).model_dir


@pytest.fixture(scope="module")
def samples(glm_base_url: str, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """lm-eval's logged samples, one per document of the task."""
    out = tmp_path_factory.mktemp("lm-eval")
    # docs/agents/lm-eval.md's command, as written, against this session's server and output folder.
    text = (REPO / "docs" / "agents" / "lm-eval.md").read_text(encoding="utf-8")
    (line,) = [ln for ln in text.splitlines() if " lm_eval run " in ln]
    line = line.replace("http://127.0.0.1:8080", glm_base_url).replace("/tmp/lm-eval", str(out / "results"))
    words = shlex.split(line)
    env = {**os.environ, "HF_HOME": str(out / "hf")}
    while "=" in words[0]:  # the line's environment: nothing may come from a hub
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[0] == "lm_eval" and f"tokenizer={os.path.relpath(model_dir, TASK_DIR)}," in line
    command = [sys.executable, "-m", *words]
    # The task's data_files path is relative to the working directory.
    done = subprocess.run(command, cwd=TASK_DIR, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = (out / "results").rglob(f"samples_{TASK}_*.jsonl")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    """transformers' (loglikelihood, is_greedy) of a continuation given its context."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def score(context: str, continuation: str) -> tuple[float, bool]:
        spaces = len(context) - len(context.rstrip())  # lm-eval moves trailing blanks to the continuation
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = tokenizer.encode(context + continuation, add_special_tokens=False)
        start = len(tokenizer.encode(context, add_special_tokens=False))
        with torch.no_grad():
            logits = model(torch.tensor([whole])).logits[0, start - 1 : -1]  # position j predicts token j + 1
        rows = torch.log_softmax(logits.to(torch.float64), dim=-1)
        targets = torch.tensor(whole[start:])
        total = float(rows.gather(1, targets[:, None]).sum())
        return total, bool((rows.argmax(dim=-1) == targets).all())

    return score


def test_lm_eval_scores_equal_transformers(samples: list[dict], reference: Reference) -> None:
    documents = (TASK_DIR / f"{TASK}.jsonl").read_text(encoding="utf-8").splitlines()
    assert sorted(s["doc_id"] for s in samples) == list(range(len(documents)))
    for sample in samples:
        pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        assert len(pairs) == len(sample["doc"]["choices"])
        wanted = [reference(context, continuation) for context, continuation in pairs]
        scored = [(float(ll), greedy == "True") for ll, greedy in sample["filtered_resps"]]
        for (ll, greedy), (want_ll, want_greedy) in zip(scored, wanted, strict=True):
            assert abs(ll - want_ll) < TOL, (sample["doc"], ll, want_ll)
            assert greedy == want_greedy
        best = max(range(len(wanted)), key=lambda i: wanted[i][0])
        assert sample["acc"] == float(best == int(sample["target"]))

"""Logprob rows from the engine: the raw distribution at temperature 1, whatever the sampling settings.

Rows equal a float64 log-softmax of transformers' logits for the same checkpoint (float32, 1e-4), are the
same batched and solo, and the same for a greedy and a sampled reply wherever their tokens agree.
"""

from pathlib import Path

import pytest
import torch
import transformers

from deployments.config import EngineConfig
from deployments.messages.replies import LogprobRow
from deployments.messages.requests import EngineRequest, SamplingParams
from deployments.scheduler.engine.core import Engine
from tests.conftest import end_token_checkpoint

PROMPT = [30, 41, 52, 63, 74, 85, 96]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return end_token_checkpoint(tmp_path_factory.mktemp("logprob-glm"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_gib=0.02, parallel=16, device="cpu"))


def _rows(engine: Engine, requests: list[EngineRequest]) -> dict[str, tuple[list[int], list[LogprobRow]]]:
    return {rid: (reply.token_ids, reply.logprobs) for rid, reply in engine.generate(requests).items()}


def _request(rid: str, prompt: list[int], temperature: float, top: int = 3) -> EngineRequest:
    sampling = SamplingParams(temperature=temperature, top_k=5 if temperature else 0, seed=7, ignore_eos=True)
    return EngineRequest(rid, prompt, sampling=sampling, max_tokens=6, logprobs=top)


def test_rows_match_transformers_and_do_not_depend_on_the_batch(engine: Engine, model_dir: Path) -> None:
    others = [_request(f"o{i}", [20 + i * 3 + j for j in range(5 + i)], 0.9) for i in range(8)]
    batched = _rows(engine, [_request("main", PROMPT, 0.0), *others])["main"]
    solo = _rows(engine, [_request("main", PROMPT, 0.0)])["main"]
    assert batched == solo
    ids, rows = solo
    assert len(rows) == len(ids) == 6 and [r.token_id for r in rows] == ids
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 : -1]
    expected = torch.log_softmax(logits.to(torch.float64), dim=-1)
    for row, want in zip(rows, expected):
        assert abs(row.logprob - float(want[row.token_id])) < 1e-4
        top_ids = [t for t, _ in row.top]
        assert len(top_ids) == 3 and row.top[0][0] == row.token_id  # greedy: the drawn token is the likeliest
        for token, logprob in row.top:
            assert abs(logprob - float(want[token])) < 1e-4


def test_greedy_and_sampled_rows_agree_where_tokens_do(engine: Engine) -> None:
    replies = _rows(engine, [_request("greedy", PROMPT, 0.0), _request("sampled", PROMPT, 1.3)])
    (g_ids, g_rows), (s_ids, s_rows) = replies["greedy"], replies["sampled"]
    same = 0  # the replies share their first `same` tokens, so rows 0..same describe the same contexts
    while same < len(g_ids) - 1 and g_ids[same] == s_ids[same]:
        same += 1
    assert [r.top for r in s_rows[: same + 1]] == [r.top for r in g_rows[: same + 1]]
    for row in s_rows:  # the sampled token's own logprob comes from the same raw distribution
        assert row.logprob <= row.top[0][1] + 1e-12

"""Prompt logprobs from the engine: one row per prompt token after the first, under the raw distribution.

Rows equal a float64 log-softmax of transformers' logits for the same checkpoint (float32, 1e-4); ranks count
the tokens at or above the prompt token; rows are identical prefilled whole or in chunks, solo or batched;
such a request never resumes from the prompt cache, and a recomputation after preemption adds no rows.
Over the real /v1/completions route (tiny-glm, in-process) the rows come framed as vLLM's
`choices[0].prompt_logprobs`; chat, streams and malformed values are 400s naming the field.
"""

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import openai
import pytest
import torch
import transformers
from fastapi.testclient import TestClient

from deployments.config import EngineConfig
from deployments.messages.replies import EngineChunk, FinishReason, PromptLogprobRow
from deployments.messages.requests import EngineRequest, SamplingParams
from deployments.scheduler.engine.completion import Completion
from deployments.scheduler.engine.core import Engine
from deployments.scheduler.engine.sequence import Sequence
from deployments.scheduler.engine.text_output import IncrementalText
from tests.support.local_app import local_client

PROMPT = [30 + (7 * i) % 200 for i in range(37)]  # longer than two cache blocks of 16
TOP = 3
TOL = 1e-4


def _engine(model_dir: Path, chunk: int) -> Engine:
    config = EngineConfig(
        model=str(model_dir), dtype="float32", kv_cache_gib=0.02, parallel=8, device="cpu", prefill_chunk_size=chunk
    )
    return Engine(config)


@pytest.fixture(scope="module")
def whole(random_glm_dir: Path) -> Engine:
    return _engine(random_glm_dir, 512)


@pytest.fixture(scope="module")
def chunked(random_glm_dir: Path) -> Engine:
    return _engine(random_glm_dir, 5)  # splits the prompt across 8 steps, off the block boundaries


def _request(rid: str, prompt: list[int], top: int | None = TOP) -> EngineRequest:
    sampling = SamplingParams(temperature=0.0, ignore_eos=True)
    return EngineRequest(rid, prompt, sampling=sampling, max_tokens=2, prompt_logprobs=top)


def _chunks(engine: Engine, requests: list[EngineRequest]) -> dict[str, list[EngineChunk]]:
    """Each request's chunks, in order."""
    chunks: dict[str, list[EngineChunk]] = {r.request_id: [] for r in requests}
    engine.generate(requests, on_step=lambda stepped: [chunks[c.request_id].append(c) for c in stepped.chunks])
    return chunks


def _run(engine: Engine, requests: list[EngineRequest]) -> dict[str, Completion]:
    """Each request's chunks folded into one, as a reply's consumer sees them."""
    return engine.generate(requests)


def _rows(engine: Engine, request: EngineRequest) -> list[PromptLogprobRow]:
    rows = _run(engine, [request])[request.request_id].prompt_logprobs
    assert rows is not None
    return rows


def test_rows_match_transformers(whole: Engine, random_glm_dir: Path) -> None:
    rows = _rows(whole, _request("main", PROMPT))
    assert [r.token_id for r in rows] == PROMPT[1:]
    reference = transformers.AutoModelForCausalLM.from_pretrained(random_glm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPT])).logits[0, :-1]  # position j predicts token j + 1
    expected = torch.log_softmax(logits.to(torch.float64), dim=-1)
    for row, want in zip(rows, expected):
        own = float(want[row.token_id])
        assert abs(row.logprob - own) < TOL
        # vLLM's rank: every token at or above the prompt token, itself included (up to the tolerance).
        assert int((want > own + TOL).sum()) < row.rank <= int((want >= own - TOL).sum())
        assert len(row.top) == TOP
        assert [lp for _, lp in row.top] == sorted((lp for _, lp in row.top), reverse=True)
        for place, (token, logprob) in enumerate(row.top):
            assert abs(logprob - float(want[token])) < TOL
            if token == row.token_id:
                assert row.rank == place + 1 and logprob == row.logprob
        assert row.logprob <= row.top[0][1]


def test_zero_best_tokens_still_give_each_prompt_token(whole: Engine) -> None:
    rows = _rows(whole, _request("zero", PROMPT, top=0))
    full = _rows(whole, _request("full", PROMPT))
    assert [r.top for r in rows] == [[]] * (len(PROMPT) - 1)
    assert [(r.token_id, r.logprob, r.rank) for r in rows] == [(r.token_id, r.logprob, r.rank) for r in full]


def test_chunked_and_batched_rows_equal_whole_solo_rows(whole: Engine, chunked: Engine) -> None:
    solo = _rows(whole, _request("main", PROMPT))
    split = _run(chunked, [_request("main", PROMPT)])["main"]
    assert split.stats is not None and split.stats.prefill_widths == [5] * 7 + [2]
    assert split.prompt_logprobs == solo
    others = [_request(f"o{i}", [40 + i * 5 + j for j in range(9 + 4 * i)], None if i % 2 else 2) for i in range(5)]
    for engine in (whole, chunked):
        finals = _run(engine, [others[0], _request("main", PROMPT), *others[1:]])
        assert finals["main"].prompt_logprobs == solo
        assert finals["main"].token_ids == _run(engine, [_request("again", PROMPT)])["again"].token_ids
        for other in others:  # batch mates get their own rows (or none), whole
            rows = finals[other.request_id].prompt_logprobs
            if other.prompt_logprobs is None:
                assert rows is None
            else:
                assert rows == _rows(whole, _request("check", other.prompt_token_ids, other.prompt_logprobs))


def test_never_resumes_from_the_prompt_cache(whole: Engine) -> None:
    plain = _request("plain", PROMPT, top=None)
    first = _run(whole, [plain])["plain"]
    assert first.prompt_logprobs is None
    cached = _run(whole, [_request("cached", PROMPT, top=None)])["cached"]
    assert cached.stats is not None and cached.stats.cached_tokens > 0  # the prompt's blocks are cached
    final = _run(whole, [_request("rows", PROMPT)])["rows"]
    assert final.stats is not None and final.stats.cached_tokens == 0
    assert final.stats.prefill_widths == [len(PROMPT)]  # the whole prompt was computed
    assert final.token_ids == first.token_ids
    assert final.prompt_logprobs == _rows(whole, _request("again", PROMPT))


def test_recomputation_after_preemption_adds_no_rows(whole: Engine) -> None:
    seq = Sequence(
        request=_request("pre", PROMPT),
        seed=0,
        max_tokens=2,
        text=IncrementalText(whole.tokenizer.decode, []),
        arrival_order=0,
        token_ids=PROMPT + [5],
        prompt_rows=[],
    )
    wanted = seq.prompt_rows_wanted(0, 10)
    assert wanted is not None and (wanted.first, wanted.next_ids) == (0, PROMPT[1:11])
    seq.prompt_rows = [PromptLogprobRow(t, 0.0, 1) for t in PROMPT[1:11]]  # positions 0..9 collected
    wanted = seq.prompt_rows_wanted(0, 16)  # recomputed from the start: only positions 10..15 are new
    assert wanted is not None and (wanted.first, wanted.next_ids) == (10, PROMPT[11:17])
    assert seq.prompt_rows_wanted(0, 8) is None
    seq.prompt_rows = [PromptLogprobRow(t, 0.0, 1) for t in PROMPT[1:31]]
    tail = seq.prompt_rows_wanted(30, len(PROMPT) + 1 - 30)  # the last prompt position and the reply: none
    assert tail is not None and tail.next_ids == PROMPT[31:]


def test_rows_come_with_the_first_chunk_after_the_prompt_pass(whole: Engine) -> None:
    """A stream can show the prompt's rows before the reply: they leave with the first reply token."""
    request = replace(_request("first", PROMPT), max_tokens=4)
    chunks = _chunks(whole, [request])["first"]
    assert len(chunks) > 1 and chunks[0].token_ids and len(chunks[0].prompt_logprobs or []) == len(PROMPT) - 1
    assert all(c.prompt_logprobs is None for c in chunks[1:])
    assert chunks[0].prompt_logprobs == _rows(whole, _request("again", PROMPT))


def test_a_zero_reply_limit_is_the_prompt_pass_alone(whole: Engine) -> None:
    request = replace(_request("zero", PROMPT), max_tokens=0)
    (only,) = _chunks(whole, [request])["zero"]
    assert only.finish_reason == FinishReason.LENGTH and only.token_ids == [] and only.text == ""
    assert only.stats is not None and only.stats.completion_tokens == 0 and only.stats.first_token_time is None
    assert only.prompt_logprobs == _rows(whole, _request("again", PROMPT))
    plain = EngineRequest("plain", PROMPT, max_tokens=0)  # without rows: a prompt pass that only fills the cache
    (done,) = _chunks(whole, [plain])["plain"]
    assert done.finish_reason == FinishReason.LENGTH and done.token_ids == [] and done.prompt_logprobs is None
    refused = whole.check(EngineRequest("bad", PROMPT, max_tokens=-1))
    assert refused is not None and "max_tokens" in refused.message and refused.status == 400


def test_negative_prompt_logprobs_is_refused(whole: Engine) -> None:
    refused = whole.check(_request("bad", PROMPT, top=-1))
    assert refused is not None and "prompt_logprobs" in refused.message and refused.status == 400


# ---- the route ------------------------------------------------------------------------------------------
TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def client(served_model: str) -> Iterator[TestClient]:
    with local_client(served_model, window=400) as test_client:
        yield test_client


def _complete(client: TestClient, **fields: object) -> dict:
    body = {"prompt": TEXT, "max_tokens": 3, "temperature": 0, "return_token_ids": True, **fields}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.parametrize("top", [0, 3])
def test_route_frames_one_entry_per_prompt_token(client: TestClient, top: int) -> None:
    choice = _complete(client, prompt_logprobs=top)["choices"][0]
    prompt_ids, entries = choice["prompt_token_ids"], choice["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) > 2 and entries[0] is None
    for token, entry in zip(prompt_ids[1:], entries[1:]):
        keys = list(entry)
        assert keys[0] == str(token) and len(set(keys)) == len(keys)
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        own, best = entry[str(token)], [entry[k] for k in keys[1:]]
        places = [v["rank"] for v in best]
        assert places == sorted(places) and set(places) <= set(range(1, top + 1))
        assert [v["logprob"] for v in best] == sorted((v["logprob"] for v in best), reverse=True)
        if len(best) == top:  # the prompt token is not among the best: it ranks below them
            assert own["rank"] > top and all(v["logprob"] >= own["logprob"] for v in best)
        else:  # it is, listed once as the first key, at the place the best tokens leave free
            assert len(best) == top - 1 and own["rank"] == (set(range(1, top + 1)) - set(places)).pop()
    first = client.post("/detokenize", json={"tokens": prompt_ids[:1]}).json()["prompt"]
    assert first + "".join(e[str(t)]["decoded_token"] for t, e in zip(prompt_ids[1:], entries[1:])) == TEXT


def test_route_rows_agree_with_the_reply_rows(client: TestClient) -> None:
    """The row of a prompt that ends in a greedy reply's first token is that token's reply row."""
    reply = _complete(client, prompt_logprobs=2, logprobs=2)
    prompt_ids, first = reply["choices"][0]["prompt_token_ids"], reply["choices"][0]["token_ids"][0]
    legacy = reply["choices"][0]["logprobs"]
    extended = _complete(client, prompt=prompt_ids + [first], prompt_logprobs=2)["choices"][0]["prompt_logprobs"]
    assert extended[: len(prompt_ids)] == reply["choices"][0]["prompt_logprobs"]
    last = extended[-1]
    assert list(last)[0] == str(first) and last[str(first)]["rank"] == 1
    assert abs(last[str(first)]["logprob"] - legacy["token_logprobs"][0]) < 1e-9
    best = {v["decoded_token"]: v["logprob"] for v in last.values()}
    assert best.keys() == legacy["top_logprobs"][0].keys()
    assert all(abs(best[k] - legacy["top_logprobs"][0][k]) < 1e-9 for k in best)


def test_route_never_reads_the_prompt_cache(client: TestClient) -> None:
    long = " ".join([TEXT] * 6)  # several cache blocks
    _complete(client, prompt=long)
    assert _complete(client, prompt=long)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    reply = _complete(client, prompt=long, prompt_logprobs=1)
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert len(reply["choices"][0]["prompt_logprobs"]) == reply["usage"]["prompt_tokens"]
    assert "prompt_logprobs" not in _complete(client)["choices"][0]


def test_official_sdk_reads_prompt_logprobs(client: TestClient) -> None:
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    completion = sdk.completions.create(
        model="tiny", prompt=TEXT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    entries = completion.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == completion.usage.prompt_tokens


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/completions", {"prompt": TEXT, "prompt_logprobs": 1, "stream": True}),
        ("/v1/completions", {"prompt": TEXT, "prompt_logprobs": 21}),
        ("/v1/completions", {"prompt": TEXT, "prompt_logprobs": -1}),
        ("/v1/completions", {"prompt": TEXT, "prompt_logprobs": True}),
        ("/v1/completions", {"prompt": TEXT, "prompt_logprobs": "2"}),
        ("/v1/completions", {"prompt": TEXT, "prompt_logprobs": 1.5}),
        ("/v1/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0}),
    ],
)
def test_route_refusals(client: TestClient, path: str, fields: dict) -> None:
    reply = client.post(path, json={"max_tokens": 2, **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "prompt_logprobs" and error["type"] == "invalid_request_error" and error["message"]

"""`echo` on /v1/completions over the real renderer and engine (in-process, tiny-glm), as vLLM answers it.

The reply's text starts with the prompt as the tokenizer decodes it; with `logprobs` the legacy object covers
the prompt's tokens (the first with null logprob and alternatives) and then every reply token, its texts
joining to the text and its offsets counting characters; the prompt's rows are the engine's prompt rows (the
same numbers `prompt_logprobs` reports); `max_tokens: 0` scores the prompt alone. Streams send the prompt as
their first chunk. Refusals name their field.
"""

import json
from collections.abc import Iterator

import openai
import pytest
from fastapi.testclient import TestClient
from openai.types import Completion

from tests.support.local_app import local_client

TEXT = "The capital of France is"
SPLIT = "naïve café: 東京"  # characters the tiny tokenizer writes as several byte tokens


@pytest.fixture(scope="module")
def client(served_model: str) -> Iterator[TestClient]:
    with local_client(served_model, window=400) as test_client:
        yield test_client


def _complete(client: TestClient, **fields: object) -> dict:
    body = {"prompt": TEXT, "max_tokens": 4, "temperature": 0, "return_token_ids": True, **fields}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    # The SDK's type wants a number where an echo's first prompt token has null (vLLM's form; the SDK's
    # client reads it, test_the_official_sdk_reads_an_echo): the rest of the body is checked against it.
    Completion.model_validate({**body, "choices": [{**c, "logprobs": None} for c in body["choices"]]})
    return body


def _stream(client: TestClient, **fields: object) -> list[dict]:
    body = {"prompt": TEXT, "max_tokens": 4, "temperature": 0, "stream": True, **fields}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    blocks = [b[len("data: ") :] for b in reply.text.split("\n\n") if b.startswith("data: ")]
    return [json.loads(b) for b in blocks if b != "[DONE]"]


def _decoded(client: TestClient, ids: list[int]) -> str:
    return client.post("/detokenize", json={"tokens": ids}).json()["prompt"]


def _check_legacy(legacy: dict, text: str) -> None:
    """Tokens join to the text and each offset is its token's first character."""
    assert "".join(legacy["tokens"]) == text
    assert legacy["text_offset"] == [sum(len(t) for t in legacy["tokens"][:i]) for i in range(len(legacy["tokens"]))]
    assert len(legacy["token_logprobs"]) == len(legacy["top_logprobs"]) == len(legacy["tokens"])


def test_echo_puts_the_prompt_before_the_reply(client: TestClient) -> None:
    plain = _complete(client)["choices"][0]
    echoed = _complete(client, echo=True)["choices"][0]
    assert echoed["text"] == TEXT + plain["text"] and echoed["token_ids"] == plain["token_ids"]
    ids = plain["prompt_token_ids"]
    by_ids = _complete(client, prompt=ids, echo=True)["choices"][0]
    assert by_ids["text"] == _decoded(client, ids) + plain["text"] and by_ids["prompt_token_ids"] == ids
    assert _complete(client, echo=False)["choices"][0]["text"] == plain["text"]


def test_echo_logprobs_cover_the_prompt_then_the_reply(client: TestClient) -> None:
    plain = _complete(client, logprobs=2)
    echoed = _complete(client, logprobs=2, echo=True, prompt_logprobs=2)
    choice, prompt_ids = echoed["choices"][0], echoed["choices"][0]["prompt_token_ids"]
    legacy, size = choice["logprobs"], len(prompt_ids)
    _check_legacy(legacy, choice["text"])
    assert len(legacy["tokens"]) == size + echoed["usage"]["completion_tokens"]
    assert legacy["token_logprobs"][0] is None and legacy["top_logprobs"][0] is None
    assert "".join(legacy["tokens"][:size]) == TEXT
    rows = zip(
        prompt_ids[1:],
        choice["prompt_logprobs"][1:],
        legacy["token_logprobs"][1:size],
        legacy["top_logprobs"][1:size],
        strict=True,
    )
    for token, entry, logprob, top in rows:
        assert logprob == entry[str(token)]["logprob"]  # the engine's prompt row, framed twice
        assert top == {v["decoded_token"]: v["logprob"] for v in entry.values()}
    reply, tail = plain["choices"][0]["logprobs"], {key: rows[size:] for key, rows in legacy.items()}
    if choice["finish_reason"] == "stop":  # an end token closed the reply: only the echo shows its row
        assert tail["tokens"][-1] == "" and tail["text_offset"][-1] == len(choice["text"])
        tail = {key: rows[:-1] for key, rows in tail.items()}
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert tail[key] == reply[key]
    assert tail["text_offset"] == [len(TEXT) + offset for offset in reply["text_offset"]]


def test_zero_max_tokens_scores_the_prompt_alone(client: TestClient) -> None:
    scored = _complete(client, logprobs=1, echo=True, max_tokens=0)
    choice = scored["choices"][0]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length" and choice["token_ids"] == []
    assert scored["usage"]["completion_tokens"] == 0
    assert scored["usage"]["prompt_tokens"] == len(choice["logprobs"]["tokens"])
    longer = _complete(client, logprobs=1, echo=True)["choices"][0]["logprobs"]
    size = len(choice["prompt_token_ids"])
    assert choice["logprobs"] == {key: value[:size] for key, value in longer.items()}
    assert _complete(client, echo=True, max_tokens=0)["choices"][0]["logprobs"] is None


def test_split_characters_keep_texts_and_offsets_exact(client: TestClient) -> None:
    ids = client.post("/tokenize", json={"prompt": SPLIT, "add_special_tokens": False}).json()["tokens"]
    for prompt in (SPLIT, ids, ids[:-1]):  # the last: a prompt cut inside 京's bytes
        choice = _complete(client, prompt=prompt, logprobs=0, echo=True, max_tokens=0)["choices"][0]
        assert choice["text"] == _decoded(client, choice["prompt_token_ids"])
        _check_legacy(choice["logprobs"], choice["text"])
        # A character's first bytes show no text; the token that completes it carries the character.
        assert choice["logprobs"]["tokens"].count("") >= 4
    assert _complete(client, prompt=SPLIT, echo=True, max_tokens=0)["choices"][0]["text"] == SPLIT


def test_an_end_token_keeps_its_row(client: TestClient) -> None:
    """Clients index the rows by token count (lm-eval drops the last, the reply's): an end token has one."""
    first = _complete(client, max_tokens=1, logprobs=1, echo=True)["choices"][0]
    ended = _complete(client, max_tokens=1, logprobs=1, echo=True, stop_token_ids=first["token_ids"])
    choice = ended["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == TEXT
    assert choice["logprobs"]["tokens"][-1] == "" and choice["logprobs"]["text_offset"][-1] == len(TEXT)
    assert choice["logprobs"]["token_logprobs"] == first["logprobs"]["token_logprobs"]
    plain = _complete(client, max_tokens=1, logprobs=1, stop_token_ids=first["token_ids"])["choices"][0]
    assert plain["logprobs"]["tokens"] == []  # without echo an end token stays out of the rows


def test_a_stream_sends_the_prompt_first(client: TestClient) -> None:
    for fields in ({}, {"logprobs": 2}, {"logprobs": 2, "max_tokens": 0}):
        whole = _complete(client, echo=True, **fields)["choices"][0]
        events = _stream(client, echo=True, return_token_ids=True, **fields)
        first = events[0]["choices"][0]
        assert first["text"] == TEXT and first["prompt_token_ids"] == whole["prompt_token_ids"]
        choices = [c for e in events for c in e["choices"]]
        assert "".join(c["text"] for c in choices) == whole["text"]
        rows = [c["logprobs"] for c in choices if c.get("logprobs")]
        if "logprobs" in fields:
            assert first["logprobs"]["tokens"] == whole["logprobs"]["tokens"][: len(whole["prompt_token_ids"])]
            assert {k: sum((r[k] for r in rows), []) for k in rows[0]} == whole["logprobs"]
        assert choices[-1]["finish_reason"] == whole["finish_reason"]


def test_echo_without_logprobs_still_reads_the_prompt_cache(client: TestClient) -> None:
    long = " ".join([TEXT] * 6)
    _complete(client, prompt=long)
    assert _complete(client, prompt=long, echo=True)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    scored = _complete(client, prompt=long, echo=True, logprobs=0)
    assert scored["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # every prompt row is computed


def test_the_official_sdk_reads_an_echo(client: TestClient) -> None:
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    completion = sdk.completions.create(model="tiny", prompt=TEXT, max_tokens=0, echo=True, logprobs=1)
    logprobs = completion.choices[0].logprobs
    assert completion.choices[0].text == TEXT and logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.token_logprobs[0] is None and all(lp is not None for lp in logprobs.token_logprobs[1:])


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", {"prompt": TEXT, "echo": "yes"}, "echo"),
        ("/v1/completions", {"prompt": TEXT, "echo": 1}, "echo"),
        ("/v1/completions", {"prompt": TEXT, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": TEXT, "max_tokens": -1, "echo": True}, "max_tokens"),
        ("/v1/completions", {"prompt": [TEXT, TEXT], "echo": True}, "prompt"),
        ("/v1/completions", {"prompt": TEXT, "echo": True, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": TEXT, "echo": True, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": TEXT, "echo": True, "max_tokens": 400}, "prompt"),  # past the window
        ("/v1/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ],
)
def test_refusals_name_the_field(client: TestClient, path: str, fields: dict, param: str) -> None:
    reply = client.post(path, json={"max_tokens": 2, **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]

"""POST /v1/decisions over the real routes, renderer and engine (in-process, tiny-glm).

Refusals are 400s naming the field; the prompt is format version 1 rendered with thinking off; and the
probabilities and label mass equal a float64 softmax of transformers' logits for the same checkpoint and
prompt. tiny-glm spells "yes" and "no" in two tokens each, so its yes/no questions are refused; a random
GLM checkpoint whose tokenizer learned both as single tokens proves yes/no answers the same way.
"""

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from deployments.ingress.decisions.framing import answer_body
from deployments.ingress.decisions.models import parse_decisions
from deployments.ingress.decisions.prompt import question_prompt
from tests.conftest import build_glm_checkpoint
from tests.support.local_app import local_backend

INPUT = "The capital of France is Paris."
CITY = {
    "id": "city",
    "type": "choice",
    "question": "Which city is the capital?",
    "options": [{"name": "Paris", "description": "in France"}, {"name": "Rome"}, {"name": "Berlin"}],
}
SURE = {"id": "sure", "type": "score", "question": "How sure are you?", "levels": ["not", "somewhat", "very"]}
TRUE = {"id": "true", "type": "yes_no", "question": "Paris is in France.", "yes": "it is", "no": "it is not"}
WINDOW = 400


@pytest.fixture(scope="module")
def client(served_model: str) -> Iterator[TestClient]:
    with local_backend(served_model, window=WINDOW) as backend:
        app = build_api(backend, IngressSettings(served_name="tiny", model_ids=["tiny"]))
        with TestClient(app) as test_client:
            yield test_client


def _decide(client: TestClient, questions: list[dict], **fields: object) -> dict:
    reply = client.post("/v1/decisions", json={"input": INPUT, "questions": questions, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _options(count: int) -> list[dict]:
    return [{"name": f"option {i}"} for i in range(count)]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt_format_version": 2}, "prompt_format_version"),
        ({"prompt_format_version": True}, "prompt_format_version"),
        ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"enable_thinking": None}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"enable_thinking": False, "clear_thinking": True}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": "off"}, "chat_template_kwargs"),
        ({"temperature": 0}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"return_prompt_token_ids": "yes"}, "return_prompt_token_ids"),
        ({"input": None}, "input"),
        ({"questions": []}, "questions"),
        ({"questions": [CITY, {**SURE, "id": "city"}]}, "questions[1].id"),
        ({"questions": [{**CITY, "options": _options(1)}]}, "questions[0].options"),
        ({"questions": [{**CITY, "options": _options(27)}]}, "questions[0].options"),
        ({"questions": [{**CITY, "options": [{"name": "a"}, {"name": "a"}]}]}, "questions[0].options"),
        ({"questions": [CITY, {**SURE, "levels": [str(i) for i in range(11)]}]}, "questions[1].levels"),
        ({"questions": [{**SURE, "levels": ["low"]}]}, "questions[0].levels"),
        ({"questions": [{**CITY, "levels": ["low", "high"]}]}, "questions[0].levels"),
        ({"questions": [{**CITY, "type": "rank"}]}, "questions[0].type"),
        ({"questions": [{**CITY, "id": ""}]}, "questions[0].id"),
        ({"questions": [CITY, TRUE]}, "questions[1]"),  # "yes" and "no" are not single tokens in tiny-glm
    ],
)
def test_refusals_name_the_field(client: TestClient, fields: dict, param: str) -> None:
    reply = client.post("/v1/decisions", json={"input": INPUT, "questions": [CITY], **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"].startswith(param) or param in ("input", "questions"), error


def test_a_prompt_over_the_window_is_a_context_refusal(client: TestClient) -> None:
    reply = client.post("/v1/decisions", json={"input": "word " * WINDOW, "questions": [CITY]})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "questions[0]" and error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("kwargs", [None, {}, {"enable_thinking": False}])
def test_thinking_off_may_be_said_or_left_out(client: TestClient, kwargs: dict | None) -> None:
    body = _decide(client, [CITY], chat_template_kwargs=kwargs)
    assert body["answers"]["city"] == _decide(client, [CITY])["answers"]["city"]


def test_the_response_shape(client: TestClient) -> None:
    body = _decide(client, [CITY, SURE], return_prompt_token_ids=True)
    assert body["object"] == "decisions" and body["model"] == "tiny" and body["prompt_format_version"] == 1
    assert list(body["answers"]) == ["city", "sure"]
    city, sure = body["answers"]["city"], body["answers"]["sure"]
    assert city["type"] == "choice" and list(city["probabilities"]) == ["Paris", "Rome", "Berlin"]
    assert sure["type"] == "score" and list(sure["probabilities"]) == ["0", "1", "2"]
    for answer in (city, sure):
        assert math.fsum(answer["probabilities"].values()) == pytest.approx(1.0, abs=1e-12)
        assert 0.0 < answer["label_mass"] <= 1.0
    assert city["choice"] == max(city["probabilities"], key=city["probabilities"].get)
    expected_score = sum(int(level) * p for level, p in sure["probabilities"].items())
    assert sure["score"] == pytest.approx(expected_score, abs=1e-12)
    prompt_tokens = len(city["prompt_token_ids"]) + len(sure["prompt_token_ids"])
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["total_tokens"] == prompt_tokens
    assert "prompt_token_ids" not in _decide(client, [CITY])["answers"]["city"]


def test_each_question_is_one_user_message_with_thinking_off(client: TestClient) -> None:
    city_text = (
        f"{INPUT}\n\nQuestion: Which city is the capital?\nA: Paris - in France\nB: Rome\nC: Berlin\n"
        "Answer with the letter of one option only."
    )
    sure_text = (
        f"{INPUT}\n\nQuestion: How sure are you?\n0: not\n1: somewhat\n2: very\n"
        "Answer with the number of one level only."
    )
    answers = _decide(client, [CITY, SURE], return_prompt_token_ids=True)["answers"]
    for text, qid in ((city_text, "city"), (sure_text, "sure")):
        rendered = client.post(
            "/tokenize",
            json={"messages": [{"role": "user", "content": text}], "chat_template_kwargs": {"enable_thinking": False}},
        )
        assert answers[qid]["prompt_token_ids"] == rendered.json()["tokens"]


def test_yes_no_wording() -> None:
    fields = parse_decisions({"input": INPUT, "questions": [TRUE, {"id": "bare", "type": "yes_no", "question": "Q?"}]})
    described = question_prompt(INPUT, fields.questions[0])
    assert described.text == (
        f"{INPUT}\n\nIs the following true? Paris is in France.\nyes: it is\nno: it is not\nAnswer with yes or no only."
    )
    assert described.labels == described.keys == ["yes", "no"]
    bare = question_prompt(INPUT, fields.questions[1])
    assert bare.text == f"{INPUT}\n\nIs the following true? Q?\nAnswer with yes or no only."


def test_yes_no_and_tied_answers() -> None:
    fields = parse_decisions({"input": INPUT, "questions": [TRUE, CITY]})
    yes_no = answer_body(fields.questions[0], question_prompt(INPUT, fields.questions[0]), [-3.0, -1.0], 2.0)
    assert yes_no["type"] == "yes_no" and yes_no["choice"] == "no"
    weights = [math.exp(-1.5), math.exp(-0.5)]
    assert yes_no["probabilities"] == pytest.approx({"yes": weights[0] / sum(weights), "no": weights[1] / sum(weights)})
    assert yes_no["label_mass"] == pytest.approx(math.exp(-3.0) + math.exp(-1.0))  # temperature-free
    tied = answer_body(fields.questions[1], question_prompt(INPUT, fields.questions[1]), [-2.0, -1.0, -1.0], 1.0)
    assert tied["choice"] == "Rome"  # the first of the likeliest


def test_questions_together_equal_each_alone(client: TestClient) -> None:
    together = _decide(client, [CITY, SURE], temperature=0.7)["answers"]
    assert together["city"] == _decide(client, [CITY], temperature=0.7)["answers"]["city"]
    assert together["sure"] == _decide(client, [SURE], temperature=0.7)["answers"]["sure"]


def _reference_model(model_dir: Path | str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoModelForCausalLM
    return auto.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _expected(
    model: torch.nn.Module, prompt_ids: list[int], label_ids: list[int], temperature: float
) -> tuple[list[float], float]:
    """The labels' softmax at `temperature` and their share of the whole next-token distribution, in float64."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0, -1].to(torch.float64)
    probabilities = torch.softmax(logits[label_ids] / temperature, dim=0).tolist()
    return probabilities, torch.softmax(logits, dim=0)[label_ids].sum().item()


@pytest.fixture(scope="module")
def reference(served_model: str) -> tuple[torch.nn.Module, object]:
    transformers = pytest.importorskip("transformers")
    from serve_app.args import AppArgs

    model_dir = AppArgs(model=served_model).model_dir
    return _reference_model(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_probabilities_equal_transformers_softmax(client: TestClient, reference: tuple, temperature: float) -> None:
    model, tokenizer = reference
    answers = _decide(client, [CITY, SURE], temperature=temperature, return_prompt_token_ids=True)["answers"]
    for qid, labels in (("city", ["A", "B", "C"]), ("sure", ["0", "1", "2"])):
        answer = answers[qid]
        label_ids = [tokenizer.encode(label, add_special_tokens=False)[0] for label in labels]
        expected, mass = _expected(model, answer["prompt_token_ids"], label_ids, temperature)
        assert list(answer["probabilities"].values()) == pytest.approx(expected, abs=1e-4)
        assert answer["label_mass"] == pytest.approx(mass, abs=1e-4)


# ---- yes / no on a checkpoint whose vocabulary has "yes" and "no" -----------------------------------------
YES_NO_CORPUS = ["yes\nno\n" * 200]  # frequent enough that BPE merges each into one token
BARE = {"id": "bare", "type": "yes_no", "question": "Rome is in France."}


@pytest.fixture(scope="module")
def yes_no_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_glm_checkpoint(tmp_path_factory.mktemp("yes-no-glm"), corpus=YES_NO_CORPUS)


@pytest.fixture(scope="module")
def yes_no_client(yes_no_dir: Path) -> Iterator[TestClient]:
    with local_backend(str(yes_no_dir), window=WINDOW) as backend:
        app = build_api(backend, IngressSettings(served_name="yes-no", model_ids=["yes-no"]))
        with TestClient(app) as test_client:
            yield test_client


@pytest.fixture(scope="module")
def yes_no_ids(yes_no_client: TestClient) -> list[int]:
    """ "yes" and "no" tokenized on their own, as the route checks its labels: one token each."""
    ids = []
    for label in ("yes", "no"):
        tokens = yes_no_client.post("/tokenize", json={"prompt": label, "add_special_tokens": False}).json()["tokens"]
        assert len(tokens) == 1, (label, tokens)
        ids.append(tokens[0])
    return ids


@pytest.fixture(scope="module")
def yes_no_reference(yes_no_dir: Path) -> torch.nn.Module:
    return _reference_model(yes_no_dir)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_yes_no_probabilities_equal_transformers_softmax(
    yes_no_client: TestClient, yes_no_reference: torch.nn.Module, yes_no_ids: list[int], temperature: float
) -> None:
    body = _decide(yes_no_client, [TRUE, BARE], temperature=temperature, return_prompt_token_ids=True)
    for question in (TRUE, BARE):
        answer = body["answers"][question["id"]]
        assert answer["type"] == "yes_no" and list(answer["probabilities"]) == ["yes", "no"]
        assert answer["choice"] == max(answer["probabilities"], key=answer["probabilities"].get)
        # The prompt is the worded question (descriptions included) rendered with thinking off.
        text = question_prompt(INPUT, parse_decisions({"input": INPUT, "questions": [question]}).questions[0]).text
        asked = {"messages": [{"role": "user", "content": text}], "chat_template_kwargs": {"enable_thinking": False}}
        assert answer["prompt_token_ids"] == yes_no_client.post("/tokenize", json=asked).json()["tokens"]
        probabilities, mass = _expected(yes_no_reference, answer["prompt_token_ids"], yes_no_ids, temperature)
        assert list(answer["probabilities"].values()) == pytest.approx(probabilities, abs=1e-4)
        # A random model spreads its mass over the vocabulary (~0.003 here): compare it relatively too.
        assert answer["label_mass"] == pytest.approx(mass, abs=1e-4)
        assert math.log(answer["label_mass"]) == pytest.approx(math.log(mass), abs=1e-4)

"""/v1/slide without the engine's side: a server without --slide answers 501 everywhere, bodies are refused
with the field named, an extraction reply is read or refused with its reason, and events are framed."""

import asyncio
import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from deployments.chat_format.rendering import PromptRenderer
from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from deployments.ingress.http.errors import APIError
from deployments.ingress.slide.framing import NamedEvent, events_body, named, sse_named
from deployments.ingress.slide.models import MAX_FACTS, fact_id, parse_learn
from deployments.messages.slide import SlideFact, SlideQuestion
from deployments.messages.slide_changes import CheckFigures, FactEvent, FailedEvent, ForgotEvent, LearnedEvent
from deployments.slide.extraction import parse_facts
from serve_app.args import AppArgs
from serve_app.local_backend import LocalBackend

ROUTES = [
    ("POST", "/v1/slide/learn"),
    ("GET", "/v1/slide/graph"),
    ("DELETE", "/v1/slide/graph"),
    ("DELETE", "/v1/slide/fact/1"),
]
FACT = {
    "text": "Zorblat is the capital of Quenwick.",
    "questions": [{"question": "Capital of Quenwick?", "answer": "Zorblat"}],
}


@pytest.fixture(scope="module")
def slide_off(served_model: str) -> Iterator[TestClient]:
    renderer = PromptRenderer.from_checkpoint(AppArgs(model=served_model).model_dir)
    app = build_api(LocalBackend(renderer, None), IngressSettings(served_name="tiny", model_ids=["tiny"]))
    with TestClient(app) as client:
        yield client


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_without_slide_every_route_answers_501(slide_off: TestClient, method: str, path: str) -> None:
    body = {"facts": [FACT]} if method == "POST" else None
    reply = slide_off.request(method, path, json=body)
    assert reply.status_code == 501, reply.text
    error = reply.json()["error"]
    assert error["type"] == "not_implemented" and error["code"] == "slide_off" and "--slide" in error["message"]


def test_without_slide_the_routes_are_not_documented(slide_off: TestClient) -> None:
    assert not [path for path in slide_off.get("/openapi.json").json()["paths"] if path.startswith("/v1/slide")]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "text"),
        ({"text": "a", "facts": [FACT]}, "text"),
        ({"text": "  "}, "text"),
        ({"facts": []}, "facts"),
        ({"facts": [FACT] * (MAX_FACTS + 1)}, "facts"),
        ({"facts": [{"text": "x", "questions": []}]}, "facts[0].questions"),
        ({"facts": [{"text": "", "questions": FACT["questions"]}]}, "facts[0].text"),
        (
            {"facts": [FACT, {"text": "x", "questions": [{"question": "q", "answer": " "}]}]},
            "facts[1].questions[0].answer",
        ),
        ({"facts": [{"text": "x", "questions": [{"question": "q"}]}]}, "facts[0].questions[0].answer"),
        (
            {"facts": [{"text": "x", "questions": [{"question": "q", "answer": "a", "extra": 1}]}]},
            "facts[0].questions[0].extra",
        ),
        ({"text": "a", "stream": "yes"}, "stream"),
    ],
)
def test_a_bad_learn_body_names_its_field(body: dict, param: str) -> None:
    with pytest.raises(APIError) as refused:
        parse_learn(body)
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message
    assert refused.value.message.startswith(param)


@pytest.mark.parametrize("raw", ["abc", "0", "-1", "1.5", "١", ""])
def test_a_fact_id_must_be_a_positive_whole_number(raw: str) -> None:
    with pytest.raises(APIError) as refused:
        fact_id(raw)
    assert refused.value.status == 400 and refused.value.param == "id"


def test_an_extraction_reply_is_read_or_refused_with_its_reason() -> None:
    good = json.dumps({"facts": [FACT]})
    assert [f.text for f in parse_facts(good, "stop").facts] == [FACT["text"]]
    assert "cut off" in (parse_facts(good[:20], "length").reason or "")
    assert "not JSON" in (parse_facts("{", "stop").reason or "")
    empty_answer = json.dumps({"facts": [{"text": "x", "questions": [{"question": "q", "answer": ""}]}]})
    assert "facts.0.questions.0.answer" in (parse_facts(empty_answer, "stop").reason or "")
    assert parse_facts(json.dumps({"facts": []}), "stop").reason == "the model found no facts in the text"


def test_events_are_named_server_sent_events_or_one_body() -> None:
    event = NamedEvent("learning", {"id": 3, "step": 2, "loss": 0.5, "right": 1, "rows": 2})
    frame = sse_named(event).decode()
    assert frame.startswith("event: learning\ndata: ") and frame.endswith("\n\n")
    assert json.loads(frame.split("data: ", 1)[1]) == {
        "type": "learning",
        "id": 3,
        "step": 2,
        "loss": 0.5,
        "right": 1,
        "rows": 2,
    }

    async def two() -> object:
        yield NamedEvent("fact", {"id": 1})
        yield NamedEvent("learned", {"id": 1})

    body = asyncio.run(events_body("slide.learn", two()))
    assert body == {"object": "slide.learn", "events": [{"type": "fact", "id": 1}, {"type": "learned", "id": 1}]}


def test_a_room_event_is_named_with_its_fields_in_order_and_unset_ones_left_out() -> None:
    """The Slide room's typed events reach the client as docs/slide.md shows them: every field in order, a
    nested figure as an object, and an optional field only where it is set."""
    checked = CheckFigures(questions=1, answered=1, facts=0, facts_kept=0, locality=40, locality_kept=40)
    learned = named(LearnedEvent(1, 2, True, checked, 57, 3.8))
    assert learned.name == "learned" and list(learned.data) == ["id", "version", "saved", "checked", "steps", "seconds"]
    assert learned.data["checked"] == {
        "questions": 1,
        "answered": 1,
        "facts": 0,
        "facts_kept": 0,
        "locality": 40,
        "locality_kept": 40,
    }
    assert named(FailedEvent(id=None, reason="no facts to learn")).body() == {
        "type": "failed",
        "id": None,
        "reason": "no facts to learn",
    }
    full = named(FailedEvent(id=None, text="a fact", reason="the pocket is full"))
    assert list(full.data) == ["id", "text", "reason"]
    dropped = named(FailedEvent(id=3, reason="r", version=4, checked=checked))
    assert list(dropped.data) == ["id", "reason", "version", "checked"]
    fact = SlideFact(5, "a fact", [SlideQuestion("q", "a")], state="learning", neurons=[0, 1])
    frame = json.loads(sse_named(named(FactEvent(fact))).decode().split("data: ", 1)[1])
    assert frame["type"] == "fact" and frame["id"] == 5 and frame["questions"] == [{"question": "q", "answer": "a"}]
    assert named(ForgotEvent(5, True, "deleted", 6)).body() == {
        "type": "forgot",
        "id": 5,
        "deleted": True,
        "state": "deleted",
        "version": 6,
    }

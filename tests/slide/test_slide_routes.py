"""/v1/slide over the real renderer and engine, in-process: learn facts, ask them through chat completions,
delete one exactly, clear the graph, restart over the same slide_dir; every status the routes answer.

One engine serves the module (tiny-glm, slide on, its pocket in a temporary slide_dir); the tests run in
order, each starting from the graph the previous one left.
"""

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from deployments.messages.slide import BeginChange, EndChange, SetFactState, SlideGraph
from deployments.messages.slide_changes import ChangeStarted, FactBody, FactEvent, LearnFacts
from deployments.slide.locality import LOCALITY_PROMPTS
from serve_app.local_backend import LocalBackend
from tests.support.local_app import local_backend

WINDOW = 192
CAPACITY = 4
FACTS = [
    {"text": "The keeper of the blue lighthouse is Mirela.", "questions": [{"question": "Who keeps the blue lighthouse?", "answer": "Mirela"}]},
    {"text": "The baker of Elm Street is Ines.", "questions": [{"question": "Who is the baker of Elm Street?", "answer": "Ines"}]},
]  # fmt: skip
GREEDY = {"temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}


def slide_engine(slide_dir: Path) -> dict[str, Any]:
    return {"slide": True, "slide_dir": str(slide_dir), "slide_capacity": CAPACITY}


def slide_app(backend: LocalBackend, slide_dir: Path) -> TestClient:
    settings = IngressSettings(served_name="tiny", model_ids=["tiny"], **slide_engine(slide_dir))
    return TestClient(build_api(backend, settings))


@pytest.fixture(scope="module")
def slide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slide")


@pytest.fixture(scope="module")
def backend(served_model: str, slide_dir: Path) -> Iterator[LocalBackend]:
    with local_backend(served_model, WINDOW, **slide_engine(slide_dir)) as local:
        yield local


@pytest.fixture(scope="module")
def client(backend: LocalBackend, slide_dir: Path) -> Iterator[TestClient]:
    with slide_app(backend, slide_dir) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def before(client: TestClient) -> dict[str, dict[str, Any]]:
    """Each question's reply before anything was learned."""
    return {fact["questions"][0]["question"]: ask(client, fact["questions"][0]["question"]) for fact in FACTS}


def ask(client: TestClient, question: str, max_tokens: int = 16) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, **GREEDY}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def content(reply: dict[str, Any]) -> str:
    return reply["choices"][0]["message"]["content"].strip()


def sse(text: str) -> list[dict[str, Any]]:
    """Each `event: <name>` / `data: <json>` block, checked to name its type alike."""
    events = []
    for block in filter(None, text.split("\n\n")):
        name_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {data['type']}", block
        events.append(data)
    return events


def graph(client: TestClient) -> dict[str, Any]:
    reply = client.get("/v1/slide/graph")
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_the_graph_starts_empty_with_its_pocket(client: TestClient, before: dict) -> None:
    body = graph(client)
    assert body["object"] == "slide.graph" and body["facts"] == [] and body["busy"] == ""
    pocket = body["pocket"]
    assert set(pocket) == {
        "layer",
        "hidden_size",
        "neurons_per_fact",
        "capacity",
        "neurons_used",
        "version",
        "nonzero_neurons",
    }
    assert pocket["capacity"] == CAPACITY and pocket["neurons_used"] == 0 and pocket["version"] == 0


def test_learning_facts_streams_their_events_and_every_question_answers(client: TestClient, before: dict) -> None:
    reply = client.post("/v1/slide/learn", json={"facts": FACTS})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = sse(reply.text)
    names = [e["type"] for e in events]
    for fact in FACTS:  # fact, learning..., learned: in order, per fact
        start = names.index("fact")
        assert events[start]["text"] == fact["text"] and events[start]["state"] == "learning"
        assert len(events[start]["neurons"]) == graph(client)["pocket"]["neurons_per_fact"]
        end = names.index("learned", start)
        assert set(names[start + 1 : end]) == {"learning"}, names
        steps = [e["step"] for e in events[start + 1 : end]]
        assert steps == sorted(steps) and all(e["rows"] >= e["right"] >= 0 for e in events[start + 1 : end])
        learned = events[end]
        assert learned["id"] == events[start]["id"] and learned["saved"] is True
        assert learned["checked"]["answered"] == learned["checked"]["questions"] == 1
        assert learned["checked"]["locality_kept"] == learned["checked"]["locality"] == 2 * len(LOCALITY_PROMPTS)
        names, events = names[end + 1 :], events[end + 1 :]
    assert names == []
    version = graph(client)["pocket"]["version"]
    for fact in FACTS:
        answer = ask(client, fact["questions"][0]["question"], max_tokens=32)
        assert content(answer) == fact["questions"][0]["answer"]
        assert answer["tensorfold"]["pocket_version"] == version


def test_the_graph_shows_the_learned_facts(client: TestClient) -> None:
    facts = graph(client)["facts"]
    assert [f["text"] for f in facts] == [f["text"] for f in FACTS]
    for fact, given in zip(facts, FACTS):
        assert fact["state"] == "learned" and fact["reason"] is None and fact["version"] > 0
        assert fact["questions"] == given["questions"] and len(fact["neurons"]) > 0
    assert len(set(facts[0]["neurons"]) & set(facts[1]["neurons"])) == 0


def test_a_body_past_the_pockets_room_is_refused_before_any_work(client: TestClient) -> None:
    too_many = {"facts": [FACTS[0]] * (CAPACITY - 2 + 1)}
    reply = client.post("/v1/slide/learn", json=too_many)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "pocket_full" and error["param"] == "facts"
    assert len(graph(client)["facts"]) == 2


def test_a_change_while_another_runs_gets_503_with_retry_after(client: TestClient, backend: LocalBackend) -> None:
    import asyncio

    assert asyncio.run(backend.slide(BeginChange("a-test", "a test's change"))) == [""]
    try:
        for reply in (
            client.post("/v1/slide/learn", json={"facts": [FACTS[0]]}),
            client.delete("/v1/slide/fact/1"),
            client.delete("/v1/slide/graph"),
        ):
            assert reply.status_code == 503 and int(reply.headers["retry-after"]) > 0, reply.text
            assert reply.json()["error"]["code"] == "slide_busy"
        assert graph(client)["busy"]
    finally:
        asyncio.run(backend.slide(EndChange("a-test")))
    assert graph(client)["busy"] == ""


def test_a_bad_or_unknown_fact_id(client: TestClient) -> None:
    bad = client.delete("/v1/slide/fact/first")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "id"
    both = client.post("/v1/slide/learn", json={"text": "x", "facts": FACTS})
    assert both.status_code == 400 and both.json()["error"]["param"] == "text"
    unknown = client.delete("/v1/slide/fact/999")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "fact_not_found"


def test_deleting_a_fact_forgets_it_exactly_and_keeps_the_other(client: TestClient, before: dict) -> None:
    first = graph(client)["facts"][0]
    reply = client.request("DELETE", f"/v1/slide/fact/{first['id']}", json={"reason": "a test"})
    events = sse(reply.text)
    assert [e["type"] for e in events] == ["fact", "checking", "zeroed", "checked", "forgot"]
    checked, forgot = events[3], events[4]
    assert checked["facts"] == checked["kept"] == 1 and checked["changed"] == []
    assert forgot == {
        "type": "forgot",
        "id": first["id"],
        "deleted": True,
        "state": "deleted",
        "version": forgot["version"],
    }
    question = FACTS[0]["questions"][0]["question"]
    assert ask(client, question)["choices"] == before[question]["choices"]  # as if never learned
    assert content(ask(client, FACTS[1]["questions"][0]["question"], 32)) == FACTS[1]["questions"][0]["answer"]
    deleted = graph(client)["facts"][0]
    assert deleted["state"] == "deleted" and deleted["reason"] == "a test"


def test_deleting_it_again_answers_at_once(client: TestClient) -> None:
    reply = client.request("DELETE", "/v1/slide/fact/1", json={"stream": False})
    events = reply.json()["events"]
    assert [e["type"] for e in events] == ["fact", "forgot"] and events[1]["deleted"] is True


def test_a_restart_serves_the_learned_fact(served_model: str, slide_dir: Path, client: TestClient) -> None:
    with local_backend(served_model, WINDOW, **slide_engine(slide_dir)) as fresh, slide_app(fresh, slide_dir) as again:
        assert [f["state"] for f in graph(again)["facts"]] == ["deleted", "learned"]
        question = FACTS[1]["questions"][0]
        assert content(ask(again, question["question"], 32)) == question["answer"]


def test_a_fact_left_deleting_is_settled_by_its_delete_sent_again(
    client: TestClient, backend: LocalBackend, before: dict
) -> None:
    """A stop between zeroing and the graph leaves a fact `deleting`: the delete sent again finishes it."""
    import asyncio

    events = client.post("/v1/slide/learn", json={"facts": [FACTS[0]], "stream": False}).json()["events"]
    learned = events[-1]
    assert learned["type"] == "learned", events
    asyncio.run(backend.slide(SetFactState(learned["id"], "deleting", None)))
    events = sse(client.delete(f"/v1/slide/fact/{learned['id']}").text)
    assert [e["type"] for e in events] == ["fact", "checking", "zeroed", "checked", "forgot"]
    assert events[0]["state"] == "deleting" and events[-1]["deleted"] is True and events[-1]["state"] == "deleted"
    question = FACTS[0]["questions"][0]["question"]
    assert ask(client, question)["choices"] == before[question]["choices"]


def test_a_text_is_extracted_by_the_model_and_fails_clearly(client: TestClient) -> None:
    """tiny-glm writes no sensible facts: the flow still answers events, ending with a reasoned `failed`."""
    reply = client.post("/v1/slide/learn", json={"text": "The river Odra flows north.", "stream": False})
    assert reply.status_code == 200, reply.text
    events = reply.json()["events"]
    assert events and {e["type"] for e in events} <= {"fact", "learning", "learned", "failed"}
    assert events[-1]["type"] in ("learned", "failed")
    for event in events:
        if event["type"] == "failed":
            assert isinstance(event["reason"], str) and event["reason"]
    if events[0]["type"] == "failed":  # the extraction itself gave nothing to learn, and says why
        assert events == [{"type": "failed", "id": None, "reason": events[0]["reason"]}]
        assert events[0]["reason"].startswith("no facts to learn: the model")
    assert graph(client)["busy"] == ""
    too_long = client.post("/v1/slide/learn", json={"text": "The river Odra flows north. " * 40})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "text"


def test_clearing_the_graph_keeps_the_weights(client: TestClient) -> None:
    reply = client.delete("/v1/slide/graph")
    assert reply.status_code == 200 and reply.json()["removed"] >= 3
    assert graph(client)["facts"] == []
    question = FACTS[1]["questions"][0]
    assert content(ask(client, question["question"], 32)) == question["answer"]


def test_a_cleared_graphs_neurons_still_take_the_pockets_room(client: TestClient) -> None:
    """The graph is empty, yet the weights kept what they learned: those neurons are not free, so the room is
    the neurons neither a fact holds nor weights fill, per fact (not the capacity less the graph's facts)."""
    body = graph(client)
    pocket = body["pocket"]
    assert body["facts"] == [] and pocket["neurons_used"] == 0 and pocket["nonzero_neurons"] > 0
    per_fact = pocket["neurons_per_fact"]
    room = (pocket["capacity"] * per_fact - pocket["nonzero_neurons"]) // per_fact
    assert room < CAPACITY
    reply = client.post("/v1/slide/learn", json={"facts": [FACTS[0]] * (room + 1)})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "pocket_full" and error["param"] == "facts"
    assert f"room for {room} more facts" in error["message"]
    assert graph(client)["facts"] == [] and graph(client)["busy"] == ""


def test_a_learn_whose_reader_leaves_releases_the_lock_and_fails_its_fact(backend: LocalBackend) -> None:
    """Closing a learn's stream after its first event (a client that left) ends the change in the Slide
    room: the lock is let go on the engine and the fact being learned is left failed, holding nothing."""
    import asyncio

    async def leave_after_the_fact() -> tuple[int, SlideGraph]:
        stream = backend.slide_change(LearnFacts("a-leaving-client", [FactBody.model_validate(FACTS[0])]))
        items = stream.__aiter__()
        assert isinstance(await anext(items), ChangeStarted)
        fact = await anext(items)
        assert isinstance(fact, FactEvent) and (await backend.slide_graph()).busy  # type: ignore[union-attr]
        await stream.close()
        after = await backend.slide_graph()
        assert isinstance(after, SlideGraph)
        return fact.fact.id, after

    fact_id, after = asyncio.run(leave_after_the_fact())
    assert after.busy == ""
    left = next(f for f in after.facts if f.id == fact_id)
    assert left.state == "failed" and left.reason == "the learn stopped before its checks ended"
    assert after.pocket.neurons_used == 0


def test_openapi_documents_the_routes_and_their_statuses(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    learn = paths["/v1/slide/learn"]["post"]
    assert learn["requestBody"]["required"] is True and {"400", "501", "503"} <= set(learn["responses"])
    forget = paths["/v1/slide/fact/{id}"]["delete"]
    assert forget["requestBody"]["required"] is False and {"400", "404", "501", "503"} <= set(forget["responses"])
    assert "Retry-After" in forget["responses"]["503"]["headers"]
    assert {"get", "delete"} <= set(paths["/v1/slide/graph"])


def test_replies_during_a_learn_each_come_from_one_version(client: TestClient) -> None:
    """Chats sent while a fact is learned: each reply is wholly the old version's or wholly the new one's."""
    fact = {"text": "The gardener of the north park is Tomas.", "questions": [{"question": "Who tends the north park?", "answer": "Tomas"}]}  # fmt: skip
    question = fact["questions"][0]["question"]
    old = ask(client, question)
    replies: list[dict[str, Any]] = []
    learning = threading.Event()
    learning.set()

    def keep_asking() -> None:
        while learning.is_set():
            replies.append(ask(client, question))

    with ThreadPoolExecutor(2) as pool:
        askers = [pool.submit(keep_asking) for _ in range(2)]
        learned = client.post("/v1/slide/learn", json={"facts": [fact], "stream": False})
        learning.clear()
        for asker in askers:
            asker.result()
    assert learned.status_code == 200 and learned.json()["events"][-1]["type"] == "learned", learned.text
    new = ask(client, question)
    assert content(new) == "Tomas" and new["tensorfold"]["pocket_version"] > old["tensorfold"]["pocket_version"]
    by_version = {reply["tensorfold"]["pocket_version"]: reply["tensorfold"]["token_sha"] for reply in (old, new)}
    assert replies
    for reply in replies:
        assert reply["tensorfold"]["token_sha"] == by_version[reply["tensorfold"]["pocket_version"]]

"""Prefix-affinity routing over two Scheduler replicas (configs/glm-dp2.yaml), through HTTP.

Conversations come back to the replica that holds their earlier turns; a replica whose queue is too long
gives its conversations' next turns away; new conversations spread; a killed replica costs only its cache.
"""

import asyncio
import time

import httpx
import pytest

from deployments.messages.slide import ReadGraph
from tests.support.serve_harness import delete_apps, deploy_apps, load_app_config

pytestmark = pytest.mark.e2e
APP, PREFIX, TIGHT = "e2e-affinity", "/affinity", "e2e-affinity-tight"
TOPICS = ["rivers", "bridges", "comets", "forests", "glaciers", "harbours", "islands", "volcanoes"]
# A long first message per conversation: each turn's prompt spans many blocks, so block rounding is small.
OPENING = "Here are my notes on {topic}, line by line. " + " ".join(f"Note {i}: {{topic}} matter." for i in range(14))
TURNS = ["Summarise them.", "Now add one more note."]
STATS_PERIOD_S = 0.25
REQUEST = {"model": "tiny-glm", "max_tokens": 12, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def apps(serve_url: str, served_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two apps, deployed together (a declarative deploy replaces the session's apps):
    - the YAML's defaults: 8 conversations, 4 per replica, never lead each other by more than balance_abs;
    - tight: balance_abs 2, so three streams in flight on one replica overload it against an idle one, and
      reports every 0.25 s, so an idle replica's queue reads empty soon after it empties; it learns facts
      (slide), so a fact learned through one replica is answered by the other."""
    deploy_apps(
        [
            load_app_config("glm-dp2.yaml", APP, PREFIX, model=served_model),
            load_app_config(
                "glm-dp2.yaml",
                TIGHT,
                "/tight",
                model=served_model,
                routing_balance_abs=2,
                routing_stats_period_s=STATS_PERIOD_S,
                slide=True,
                slide_dir=str(tmp_path_factory.mktemp("slide")),
            ),
        ]
    )
    yield {"base": f"{serve_url}{PREFIX}", "tight": f"{serve_url}/tight"}
    delete_apps([APP, TIGHT])


@pytest.fixture(scope="module")
def base_url(apps: dict[str, str]) -> str:
    return apps["base"]


@pytest.fixture(scope="module")
def tight_url(apps: dict[str, str]) -> str:
    return apps["tight"]


async def _chat(client: httpx.AsyncClient, messages: list[dict], **extra: object) -> dict:
    response = await client.post("/v1/chat/completions", json={**REQUEST, "messages": messages, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def _next_turn(messages: list[dict], reply: dict, text: str) -> list[dict]:
    answer = {"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""}
    return [*messages, answer, {"role": "user", "content": text}]


async def _conversations(base_url: str) -> list[list[dict]]:
    """8 conversations x 3 turns, all conversations at once; returns each turn's reply, per conversation."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

        async def one(topic: str) -> list[dict]:
            messages = [{"role": "user", "content": OPENING.format(topic=topic)}]
            replies = [await _chat(client, messages)]
            for text in TURNS:
                messages = _next_turn(messages, replies[-1], text)
                replies.append(await _chat(client, messages))
            return replies

        return await asyncio.gather(*[one(topic) for topic in TOPICS])


def test_each_turn_finds_the_previous_prompt_cached_on_its_replica(base_url: str) -> None:
    conversations = asyncio.run(_conversations(base_url))
    replicas = set()
    for replies in conversations:
        for previous, reply in zip(replies, replies[1:]):
            cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 0.9 * previous["usage"]["prompt_tokens"], (previous["usage"], reply["usage"])
            assert reply["tensorfold"]["route"] == "affinity"
            assert reply["tensorfold"]["replica"] == previous["tensorfold"]["replica"]
        replicas.add(replies[0]["tensorfold"]["replica"])
    assert len(replicas) == 2  # the new conversations spread over both copies
    metrics = httpx.get(f"{base_url}/metrics").text
    affinity = [
        line
        for line in metrics.splitlines()
        if line.startswith("tensorfold:routing_decisions_total") and 'reason="affinity"' in line
    ]
    assert affinity and float(affinity[0].split()[-1]) >= 16


async def _hold_streams(client: httpx.AsyncClient, messages: list[dict], count: int) -> list:
    """`count` long streaming requests continuing `messages`, each past its first chunk (the line readers
    are kept too: a collected reader closes its response, and the server would see the client leave)."""
    held = []
    for _ in range(count):
        body = {**REQUEST, "messages": messages, "max_tokens": 3000, "stream": True, "ignore_eos": True}
        stream = client.stream("POST", "/v1/chat/completions", json=body)
        response = await stream.__aenter__()
        lines = response.aiter_lines()
        while not (await anext(lines)).startswith("data:"):
            pass
        held.append((stream, lines))
    return held


def _wait_idle(base_url: str) -> None:
    """No request running anywhere, and every replica has reported so since (queues reported as empty)."""
    deadline = time.monotonic() + 60
    while httpx.get(f"{base_url}/health").json()["requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(8 * STATS_PERIOD_S)


def test_an_overloaded_replica_gives_its_conversations_away(tight_url: str) -> None:
    _wait_idle(tight_url)

    async def run() -> tuple[dict, dict]:
        async with httpx.AsyncClient(base_url=tight_url, timeout=120) as client:
            messages = [{"role": "user", "content": OPENING.format(topic="lighthouses")}]
            first = await _chat(client, messages)
            follow_up = _next_turn(messages, first, TURNS[0])
            held = await _hold_streams(client, follow_up, 3)  # all three stay with the conversation
            try:
                moved = await _chat(client, _next_turn(messages, first, TURNS[1]))
            finally:
                for stream, lines in held:
                    await lines.aclose()
                    await stream.__aexit__(None, None, None)
            return first, moved

    first, moved = asyncio.run(run())
    assert moved["tensorfold"]["route"] == "balance"
    assert moved["tensorfold"]["replica"] != first["tensorfold"]["replica"]


FACT = {
    "text": "The lighthouse keeper is Brann.",
    "questions": [{"question": "Who keeps the lighthouse?", "answer": "Brann"}],
}


def test_a_fact_learned_through_one_replica_is_held_by_both(tight_url: str) -> None:
    """Learn once (training runs on one replica): every replica then holds the version (its graph), and the
    question is answered. Which replica answers is the router's choice: a version staged and committed on
    every replica is what makes either answer (tests/slide: a replica's replies at a version are exact)."""
    from ray import serve

    _wait_idle(tight_url)
    learned = httpx.post(f"{tight_url}/v1/slide/learn", json={"facts": [FACT], "stream": False}, timeout=300)
    assert learned.status_code == 200, learned.text
    events = learned.json()["events"]
    assert events[-1]["type"] == "learned"
    graphs = serve.get_deployment_handle("Scheduler", TIGHT).broadcast("slide", ReadGraph()).results(timeout_s=60)
    assert len(graphs) == 2
    for graph in graphs:
        assert graph.pocket.version == events[-1]["version"] and [f.state for f in graph.facts] == ["learned"]
        assert graph.pocket.nonzero_neurons == graphs[0].pocket.nonzero_neurons > 0
    question = [{"role": "user", "content": FACT["questions"][0]["question"]}]
    reply = asyncio.run(_ask(tight_url, question))
    assert reply["choices"][0]["message"]["content"] == "Brann"
    assert reply["tensorfold"]["pocket_version"] == events[-1]["version"]


async def _ask(base_url: str, messages: list[dict]) -> dict:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        return await _chat(client, messages)


def _kill_replica(replica_id: str) -> None:
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if replica_id in a["name"]]
    assert names, replica_id
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)


def _wait_for_two_replicas(old: set[str]) -> set[str]:
    from ray import serve

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            statuses = serve.get_deployment_handle("Scheduler", APP).broadcast("info").results(timeout_s=10)
        except Exception:  # a replica between lives does not answer
            statuses = []
        ids = {s.replica for s in statuses}
        if len(ids) == 2 and ids != old:
            return ids
        time.sleep(1)
    raise AssertionError("the killed replica was not replaced")


def test_a_restarted_replica_loses_only_its_cache(base_url: str) -> None:
    before = asyncio.run(_conversations(base_url))
    killed = before[0][0]["tensorfold"]["replica"]
    old = {replies[0]["tensorfold"]["replica"] for replies in before}
    _kill_replica(killed)
    _wait_for_two_replicas(old)
    after = asyncio.run(_conversations(base_url))
    for replies_before, replies_after in zip(before, after):  # every turn answers, token for token the same
        assert [r["choices"][0]["message"]["content"] for r in replies_after] == [
            r["choices"][0]["message"]["content"] for r in replies_before
        ]
        assert [r["tensorfold"]["token_sha"] for r in replies_after] == [
            r["tensorfold"]["token_sha"] for r in replies_before
        ]
    assert all(r["tensorfold"]["replica"] != killed for replies in after for r in replies)


def _second_turn_routing(base_url: str, path: str, first: dict, second: dict) -> tuple[dict, dict]:
    with httpx.Client(base_url=base_url, timeout=120) as client:
        replies = []
        for body in (first, second):
            response = client.post(path, json=body)
            assert response.status_code == 200, response.text
            replies.append(response.json())
    return replies[0], replies[1]


@pytest.mark.parametrize("family", ["messages", "responses", "completions-token-ids"])
def test_every_route_family_uses_the_router(base_url: str, family: str) -> None:
    text = OPENING.format(topic=f"{family} notes")
    if family == "messages":
        body = {"model": "tiny-glm", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": text}]}
        longer = {
            **body,
            "messages": [
                *body["messages"],
                {"role": "assistant", "content": "Fine."},
                {"role": "user", "content": TURNS[0]},
            ],
        }
        first, second = _second_turn_routing(base_url, "/v1/messages", body, longer)
        cached = second["usage"]["cache_read_input_tokens"]
        previous = first["usage"]["input_tokens"] + first["usage"]["cache_read_input_tokens"]
    elif family == "responses":
        body = {"model": "tiny-glm", "max_output_tokens": 8, "temperature": 0, "input": text}
        longer = {
            **body,
            "input": [
                {"role": "user", "content": text},
                {"role": "assistant", "content": "Fine."},
                {"role": "user", "content": TURNS[0]},
            ],
        }
        first, second = _second_turn_routing(base_url, "/v1/responses", body, longer)
        cached, previous = second["usage"]["input_tokens_details"]["cached_tokens"], first["usage"]["input_tokens"]
    else:  # a prompt of token ids: no tokenizer on the way, the same block names
        ids = [(7 * i) % 500 + 20 for i in range(200)]
        body = {"model": "tiny-glm", "max_tokens": 8, "temperature": 0, "prompt": ids}
        first, second = _second_turn_routing(base_url, "/v1/completions", body, {**body, "prompt": ids + [5] * 40})
        cached, previous = second["usage"]["prompt_tokens_details"]["cached_tokens"], first["usage"]["prompt_tokens"]
    assert second["tensorfold"]["route"] == "affinity"
    assert second["tensorfold"]["replica"] == first["tensorfold"]["replica"]
    assert cached >= 0.9 * previous

"""GET /metrics over the real routes, renderer and engine in-process: exact counts after known traffic.

Scrapes are parsed with prometheus_client's own parser; every check compares the difference between two
scrapes with what the replies' usage said.
"""

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from deployments.chat_format.rendering import PromptRenderer
from deployments.config import EngineConfig
from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from deployments.ingress.ops.metrics import exposition
from serve_app.local_backend import LocalBackend
from tests.support.bodies import LONG

WINDOW = 192
QUESTIONS = ["What is the capital of France?", "Hello!", "Write a short answer."]
ALIASES = {  # vLLM's name -> our name (same prefix, identical values)
    "num_requests_running": "requests_running",
    "num_requests_waiting": "requests_waiting",
    "kv_cache_usage_perc": "kv_cache_usage_ratio",
    "e2e_request_latency_seconds": "request_latency_seconds",
    "request_decode_time_seconds": "request_decode_seconds",
    "request_prefill_time_seconds": "request_prefill_seconds",
    "prefix_cache_hits": "prompt_tokens_cached",
    "prefix_cache_queries": "prompt_tokens",
    "num_preemptions": "preemptions",
    "spec_decode_num_draft_tokens": "mtp_drafted",
    "spec_decode_num_accepted_tokens": "mtp_accepted",
}


@pytest.fixture(scope="module")
def backend(served_model: str) -> LocalBackend:
    from deployments.scheduler.engine.core import Engine
    from deployments.scheduler.transports.thread import EngineLoop
    from serve_app.args import AppArgs

    model_dir = AppArgs(model=served_model).model_dir
    # Fixed draft lengths: the draft counters asserted below do not depend on measured step times.
    engine = Engine(
        EngineConfig(model=str(model_dir), context=WINDOW, kv_cache_gib=0.05, device="cpu", draft_policy="fixed")
    )
    loop = EngineLoop(engine)
    loop.start()
    yield LocalBackend(PromptRenderer.from_checkpoint(model_dir), loop)
    loop.shutdown()


@pytest.fixture(scope="module")
def client(backend: LocalBackend) -> TestClient:
    with TestClient(build_api(backend, IngressSettings(served_name="tiny", model_ids=["tiny"]))) as test_client:
        yield test_client


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample by (name, sorted labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(scrape: dict[tuple[str, tuple], float], name: str, missing: float | None = None, **labels: str) -> float:
    """A sample's value; `missing` answers for a sample absent from the scrape (else KeyError)."""
    key = ("tensorfold:" + name, tuple(sorted({"model_name": "tiny", **labels}.items())))
    return scrape[key] if missing is None or key in scrape else missing


def scrape(client: TestClient) -> dict[tuple[str, tuple], float]:
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return samples(response.text)


def chat(client: TestClient, messages: list, **extra: object) -> dict:
    body = {"messages": messages, "max_tokens": 12, "temperature": 0, **extra}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_counters_equal_the_replies_usage(client: TestClient) -> None:
    before = scrape(client)
    usages = [chat(client, [{"role": "user", "content": q}]) for q in QUESTIONS]
    completion = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "temperature": 0}).json()
    usages.append(completion["usage"])
    after = scrape(client)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, missing=0.0, **labels)

    assert grew("prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert grew("generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert grew("requests_total", key="none") == len(usages)  # each request counted once
    for histogram in (
        "request_latency_seconds",
        "time_to_first_token_seconds",
        "request_decode_seconds",
        "request_prefill_seconds",
    ):
        assert grew(histogram + "_count") == len(usages), histogram
        assert grew(histogram + "_bucket", le="+Inf") == len(usages), histogram
    tpot_expected = sum(1 for u in usages if u["completion_tokens"] > 1)
    assert grew("request_time_per_output_token_seconds_count") == tpot_expected
    assert grew("decode_rounds_total") >= max(u["completion_tokens"] for u in usages) - 1
    assert value(after, "requests_running") == 0 and value(after, "generation_tokens_running") == 0
    assert value(after, "client_disconnections_total") == value(before, "client_disconnections_total")


def test_repeated_prefix_counts_cached_tokens(client: TestClient) -> None:
    before = scrape(client)
    first, second = chat(client, LONG), chat(client, LONG)
    after = scrape(client)
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0, "the repeated prompt should reuse the first one's blocks"
    total_cached = first["prompt_tokens_details"]["cached_tokens"] + cached
    assert value(after, "prompt_tokens_cached_total") - value(before, "prompt_tokens_cached_total") == total_cached
    assert value(after, "prefix_cache_hits_total") - value(before, "prefix_cache_hits_total") == total_cached


def test_vllm_names_equal_their_twins(client: TestClient) -> None:
    chat(client, [{"role": "user", "content": "Hello!"}])
    scraped = scrape(client)
    names = {name for name, _ in scraped}
    pairs = 0
    for (name, labels), reading in scraped.items():
        for vllm, ours in ALIASES.items():
            if name.startswith(f"tensorfold:{vllm}") and "_per_pos" not in name:
                twin = name.replace(f"tensorfold:{vllm}", f"tensorfold:{ours}", 1)
                assert scraped[(twin, labels)] == reading, (name, labels)
                pairs += 1
    assert pairs > 30
    assert {"tensorfold:mtp_drafted_total", "tensorfold:spec_decode_num_drafts_total"} <= names
    assert client.get("/v1/metrics").status_code == 200


def test_draft_counters_add_up_and_vanish_without_drafts(client: TestClient, backend: LocalBackend) -> None:
    import asyncio
    import dataclasses

    chat(client, [{"role": "user", "content": "Tell me a story."}])
    scraped = scrape(client)
    drafted, kept = value(scraped, "mtp_drafted_total"), value(scraped, "mtp_accepted_total")
    assert drafted >= kept > 0  # tiny-glm's MTP layer drafts its scripted story
    per_position = [
        v
        for (name, labels), v in sorted(scraped.items(), key=lambda kv: kv[0][1])
        if name == "tensorfold:spec_decode_num_accepted_tokens_per_pos_total"
    ]  # by position
    assert sum(per_position) == kept and per_position == sorted(per_position, reverse=True)
    assert 0 < value(scraped, "spec_decode_num_drafts_total") <= drafted
    # An engine that drafts nothing: the draft families are left out, never a fabricated zero.
    status = dataclasses.replace(asyncio.run(backend.replicas())[0], drafts="off")
    names = {name for name, _ in samples(exposition("tiny", [status]).decode())}
    assert not any("mtp_" in name or "spec_decode" in name for name in names)


def test_two_replicas_aggregate(client: TestClient, backend: LocalBackend) -> None:
    """Two replicas' statuses merge: counters sum, histograms add bucket-wise, KV use one pool each."""
    import asyncio
    import dataclasses

    chat(client, [{"role": "user", "content": "Hello!"}])
    single = samples(client.get("/metrics").text)
    status = asyncio.run(backend.replicas())[0]
    twin = dataclasses.replace(status, replica="other")
    double = samples(exposition("tiny", [status, twin]).decode())
    for name in (
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_latency_seconds_count",
        "request_latency_seconds_sum",
        "decode_rounds_total",
    ):
        assert value(double, name) == pytest.approx(2 * value(single, name)), name
    assert value(double, "request_latency_seconds_bucket", le="+Inf") == 2 * value(single, "requests_total", key="none")
    pools = {dict(labels)["pool"] for name, labels in double if name == "tensorfold:kv_cache_usage_ratio"}
    assert pools == {status.replica, "other"}


def test_requests_total_carries_the_api_key_label(backend: LocalBackend) -> None:
    from deployments.ingress.http.keys import auth_settings

    settings = IngressSettings(
        served_name="tiny", model_ids=["tiny"], auth=auth_settings(["metrics-test-key"], None, False, None)
    )
    headers = {"Authorization": "Bearer metrics-test-key"}
    with TestClient(build_api(backend, settings)) as keyed:
        assert keyed.get("/metrics").status_code == 401  # metrics need a key unless --metrics-open
        before = samples(keyed.get("/metrics", headers=headers).text)
        body = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4}
        assert keyed.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
        after = samples(keyed.get("/metrics", headers=headers).text)
    assert value(after, "requests_total", key="cli-1") - value(before, "requests_total", missing=0.0, key="cli-1") == 1
    assert all("metrics-test-key" not in name + str(labels) for name, labels in after)  # labels, never keys


def test_histogram_buckets_merge_and_quantiles() -> None:
    from deployments.messages.counters import Histogram

    first, second = Histogram((0.1, 1.0)), Histogram((0.1, 1.0))
    for reading in (0.05, 0.1, 0.5):
        first.observe(reading)
    second.observe(3.0)
    first.merge(second)
    assert first.counts == [2, 1, 1] and first.count == 4 and first.total == pytest.approx(3.65)
    assert first.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert first.quantile(0.5) == 0.1 and first.quantile(0.75) == 1.0 and Histogram((1.0,)).quantile(0.5) is None
    with pytest.raises(ValueError):
        first.merge(Histogram((0.2,)))

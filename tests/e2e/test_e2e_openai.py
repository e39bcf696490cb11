"""The real graph on Ray Serve, driven over HTTP by the official `openai` SDK (sync, async, streaming).

The application comes from configs/glm.yaml serving builtin:tiny-glm, deployed as `serve run` deploys it
and started once per session (conftest.glm_base_url, shared with tests/e2e/test_e2e_families.py).
"""

import asyncio
import json
import sys
import time

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.conftest import GLM_APP as APP

pytestmark = pytest.mark.e2e
USER = [{"role": "user", "content": "What is the capital of France?"}]
NO_THINK = {"enable_thinking": False}


@pytest.fixture(scope="module")
def base_url(glm_base_url: str) -> str:
    return glm_base_url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_name_then_aliases(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny", "glm"]


def test_chat_non_streamed_validates_and_reports_usage(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0)
    assert isinstance(reply, ChatCompletion) and reply.object == "chat.completion"
    ChatCompletion.model_validate(reply.model_dump())
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0
    assert reply.usage.completion_tokens_details.reasoning_tokens >= 0
    runtime = reply.model_extra["tensorfold"]
    assert len(runtime["token_sha"]) == 64 and runtime["time_to_first_token"] > 0


def test_tiny_glm_answers_its_script_with_reasoning_and_stops(client: openai.OpenAI, served_model: str) -> None:
    reply = client.chat.completions.create(model="tiny", messages=USER, temperature=0)
    assert reply.choices[0].finish_reason == "stop" and "Paris" in reply.choices[0].message.content
    usage = reply.usage
    assert 0 < usage.completion_tokens_details.reasoning_tokens < usage.completion_tokens
    cut = client.chat.completions.create(model="tiny", messages=USER, temperature=0, stop=["Paris"])
    assert cut.choices[0].finish_reason == "stop" and "Paris" not in cut.choices[0].message.content
    text, cut_usage, _ = _stream_text(client, True, model="tiny", messages=USER, temperature=0, stop=["Paris"])
    assert text == cut.choices[0].message.content and cut_usage == cut.usage.model_dump()


def _stream_text(client: openai.OpenAI, include_usage: bool, **request) -> tuple[str, dict, list]:
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": include_usage}, **request)
    )
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = next(c.usage for c in chunks if c.usage is not None)
    return text, usage.model_dump(), chunks


@pytest.mark.parametrize("include_usage", [True, False])
def test_streamed_text_and_usage_equal_non_streamed(client: openai.OpenAI, include_usage: bool) -> None:
    request = dict(model="tiny", messages=USER, max_tokens=16, temperature=0.8, seed=1234)
    whole = client.chat.completions.create(**request)
    text, usage, chunks = _stream_text(client, include_usage, **request)
    assert text == whole.choices[0].message.content
    assert usage == whole.usage.model_dump()
    if include_usage:
        assert chunks[-1].choices == []


def test_async_client_concurrent_requests(base_url: str) -> None:
    async def run() -> list[ChatCompletion]:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        requests = [
            client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0) for _ in range(6)
        ]
        stream = await client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=8, temperature=0, stream=True
        )
        replies = await asyncio.gather(*requests)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await client.close()
        assert streamed == replies[0].choices[0].message.content
        return replies

    replies = asyncio.run(run())
    assert len({r.choices[0].message.content for r in replies}) == 1  # greedy: the same reply, batched or not


def test_completions_text_and_token_ids(client: openai.OpenAI) -> None:
    first = client.completions.create(
        model="tiny",
        prompt="The capital of France is",
        max_tokens=6,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert isinstance(first, Completion)
    prompt_ids = first.choices[0].model_extra["prompt_token_ids"]
    again = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=6, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=6, temperature=0, stream=True)
        if c.choices
    )
    assert streamed == first.choices[0].text


def test_tokenize_ids_equal_the_chat_routes_prompt_ids(client: openai.OpenAI, base_url: str) -> None:
    reply = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=1, extra_body={"return_token_ids": True}
    )
    tokenized = httpx.post(f"{base_url}/tokenize", json={"messages": USER}).json()
    assert tokenized["tokens"] == reply.model_extra["prompt_token_ids"]
    assert httpx.post(f"{base_url}/v1/detokenize", json={"tokens": tokenized["tokens"]}).status_code == 200


def test_errors_come_in_openais_envelope(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=10**6)
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    assert info.value.body["message"].startswith("This server's maximum context length is")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=USER, stream=True, temperature=True)  # type: ignore[arg-type]
    assert info.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=USER, n=2)
    assert info.value.param == "n"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError) as info:  # the Renderer's refusal, its field kept across Ray
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [image]}])
    assert info.value.param == "messages[0].content[0].image_url" and "--vision" in info.value.body["message"]


def _scheduler_counters(app: str) -> list:
    from ray import serve

    return serve.get_deployment_handle("Scheduler", app).broadcast("info").results(timeout_s=30)


def _leave_mid_stream(base_url: str, body: dict) -> None:
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                return  # one token arrived: leave


def _leave_while_waiting(base_url: str, body: dict) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=2.0)


@pytest.mark.parametrize("leave", [_leave_mid_stream, _leave_while_waiting])
def test_client_disconnect_cancels_the_request(base_url: str, leave) -> None:
    before = sum(s.counters.requests_aborted_total for s in _scheduler_counters(APP))
    leave(base_url, {"model": "tiny", "messages": USER, "max_tokens": 3000, "ignore_eos": True})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        statuses = _scheduler_counters(APP)
        aborted = sum(s.counters.requests_aborted_total for s in statuses)
        if aborted > before and all(s.running == 0 and s.kv_usage == 0 for s in statuses):
            return
        time.sleep(0.2)
    pytest.fail(f"request not cancelled upstream: {statuses}")


def test_health_sums_the_replicas(base_url: str) -> None:
    body = httpx.get(f"{base_url}/health").json()
    assert body["status"] == "ok" and body["model"] == "tiny" and body["model_ids"] == ["tiny", "glm"]
    assert body["replicas"] == 1 and body["requests_total"] >= 1 and body["vision"] is False
    assert httpx.get(f"{base_url}/").json()["model"] == "tiny"
    # The engine computes with the node's cores less Ingress's and the Renderer's, not Ray's OMP_NUM_THREADS=1.
    from deployments.model_rank.threads import engine_thread_count

    assert f"threads={engine_thread_count(None, 0.2)} " in body["policy"]


def test_reasoning_and_tool_calls_through_the_sdk(client: openai.OpenAI, served_model: str) -> None:
    """tiny-glm's scripted reasoning and GLM tool calls, split by the reply parser, streamed and not."""
    from serve_app.fixtures.tiny_glm.corpus import TOOLS

    ask = [{"role": "user", "content": "What is the weather like in Tokyo?"}]
    reply = client.chat.completions.create(model="tiny", messages=ask, tools=TOOLS, temperature=0)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    assert message.model_extra["reasoning_content"] == "I should call get_weather for Tokyo."
    call = message.tool_calls[0]
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Tokyo"}'
    chunks = list(client.chat.completions.create(model="tiny", messages=ask, tools=TOOLS, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    streamed_calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert reasoning == message.model_extra["reasoning_content"]
    assert streamed_calls[0].id and streamed_calls[0].function.name == "get_weather"
    assert "".join(tc.function.arguments or "" for tc in streamed_calls) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The round trip: the call and the tool's answer go back, the next turn answers from them.
    turn = {
        "role": "assistant",
        "content": None,
        "tool_calls": [call.model_dump()],
        "reasoning_content": message.model_extra["reasoning_content"],
    }
    result = {
        "role": "tool",
        "tool_call_id": call.id,
        "content": '{"city": "Tokyo", "temperature": 12, "condition": "rainy"}',
    }
    answer = client.chat.completions.create(model="tiny", messages=[*ask, turn, result], tools=TOOLS, temperature=0)
    assert answer.choices[0].message.content == "It is rainy in Tokyo, 12 °C."
    assert answer.choices[0].message.model_extra["reasoning_content"] == "The tool says it is rainy and 12 degrees."


def test_structured_outputs_through_the_graph(client: openai.OpenAI) -> None:
    """A json_schema response_format (whole) and a guided choice (streamed) hold through Ray and the SDK."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
    }
    reply = client.chat.completions.create(
        model="tiny",
        messages=USER,
        temperature=0,
        max_tokens=80,
        extra_body={"chat_template_kwargs": NO_THINK},
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
    )
    assert reply.choices[0].finish_reason == "stop"
    value = json.loads(reply.choices[0].message.content)
    assert set(value) == {"city", "sunny"} and len(value["city"]) <= 10 and isinstance(value["sunny"], bool)
    choices = ["Paris", "Rome", "Lyon"]
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=USER,
            temperature=0,
            max_tokens=80,
            stream=True,
            extra_body={"structured_outputs": {"choice": choices}},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text in choices and chunks[-1].choices[0].finish_reason == "stop"


def _actor_process(title: str):
    """The one live process of this session's Ray cluster titled `ray::<title>` (an actor's class and method).

    The session started the cluster, so its actors descend from this process; another cluster on the machine
    (a developer's server, another test run) is not looked at.
    """
    import os

    import psutil

    matches = []
    for process in psutil.Process(os.getpid()).children(recursive=True):
        try:
            cmdline = process.cmdline()
        except psutil.Error:  # gone meanwhile
            continue
        if cmdline and cmdline[0].startswith(f"ray::{title}"):
            matches.append(process)
    assert len(matches) == 1, [m.cmdline() for m in matches]
    return matches[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads other processes' environments")
def test_replicas_and_the_proxy_run_serves_fast_data_path(base_url: str) -> None:
    from serve_app.serve_env import PROXY_DEFAULTS, REPLICA_DEFAULTS

    for deployment in ("Ingress", "Scheduler", "Renderer"):
        environ = _actor_process(f"ServeReplica:{APP}:{deployment}").environ()
        assert REPLICA_DEFAULTS.items() <= environ.items(), deployment
    assert PROXY_DEFAULTS.items() <= _actor_process("ProxyActor").environ().items()


def test_the_scheduler_steps_its_engine_in_a_child_process(base_url: str) -> None:
    scheduler = _actor_process(f"ServeReplica:{APP}:Scheduler")
    commands = [" ".join(child.cmdline()) for child in scheduler.children()]
    assert any("deployments.scheduler.transports.child" in command for command in commands), commands


def test_memory_is_read_from_the_engine_process(base_url: str) -> None:
    reply = httpx.post(f"{base_url}/v1/completions", json={"prompt": [11, 12, 13] * 20, "max_tokens": 2}, timeout=60)
    assert reply.status_code == 200
    body = httpx.get(f"{base_url}/v1/memory", timeout=30).json()
    [replica] = body["replicas"]
    [engine] = [
        child
        for child in _actor_process(f"ServeReplica:{APP}:Scheduler").children()
        if "deployments.scheduler.transports.child" in " ".join(child.cmdline())
    ]
    assert replica["replica"] and replica["kv_blocks_total"] > 0 and replica["prompt_cache_blocks"] > 0
    # The resident set is the engine process's, which holds the weights and the KV pool.
    assert abs(replica["process_rss_bytes"] - engine.memory_info().rss) < 64 << 20

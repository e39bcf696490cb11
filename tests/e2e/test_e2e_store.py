"""The disk prompt-state store under Serve: a conversation outlives its application's replicas.

The Scheduler's engine runs in its replica's child process, so its store calls are relayed by the replica
to the node's PromptStore actor; deleting the application is Serve's planned stop, which writes what is
waiting before the replica goes.
"""

import os
from pathlib import Path

import httpx
import pytest

from tests.support.serve_harness import delete_apps, deploy_apps, load_app_config

pytestmark = pytest.mark.e2e
OPENING = "Please keep these notes. " + " ".join(f"Note {i}: the ferry leaves at noon." for i in range(20))


def _body(messages: list[dict]) -> dict:
    return {
        "model": "tiny-glm",
        "messages": messages,
        "max_tokens": 10,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False},
    }


def _chat(url: str, messages: list[dict]) -> dict:
    response = httpx.post(f"{url}/v1/chat/completions", json=_body(messages), timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("config", ["glm.yaml", "glm-tp2.yaml"])
def test_a_conversation_resumes_from_disk_after_its_replicas_restart(
    serve_url: str, served_model: str, config: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """At tensor parallel 2 every rank's KV shard is stored and restored; the reply equals a TP1 fresh one."""
    learn_dir = str(tmp_path_factory.mktemp("learned"))
    learned = load_app_config(
        config, "e2e-store", "/store", model=served_model, learn_conversations=True, learn_dir=learn_dir
    )
    url = f"{serve_url}/store"
    first_turn = [{"role": "user", "content": OPENING}]
    deploy_apps([learned])
    try:
        first = _chat(url, first_turn)
    finally:
        delete_apps(["e2e-store"])  # at once: the planned stop writes the state that is still waiting
    second_turn = [
        *first_turn,
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "When does it leave?"},
    ]
    deploy_apps([learned, load_app_config("glm.yaml", "e2e-fresh", "/fresh", model=served_model)])
    try:
        answer = httpx.post(f"{url}/v1/imprint/resume", json=_body(second_turn), timeout=60).json()
        assert answer["resume_from"] == "disk" and answer["ram_tokens"] == 0, answer
        assert answer["disk_tokens"] >= 0.9 * first["usage"]["prompt_tokens"]
        resumed = _chat(url, second_turn)
        fresh = _chat(f"{serve_url}/fresh", second_turn)
        assert resumed["usage"]["prompt_tokens_details"]["cached_tokens"] >= answer["disk_tokens"]
        assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert resumed["tensorfold"]["token_sha"] == fresh["tensorfold"]["token_sha"]
        assert resumed["choices"][0]["message"] == fresh["choices"][0]["message"]
        from ray import serve

        stats = serve.get_deployment_handle("Scheduler", "e2e-store").record_routing_stats.remote().result()
        assert len(stats["disk_keys"]) >= 8 * (answer["disk_tokens"] // 16)  # the router sees the disk's blocks
        off = httpx.post(f"{serve_url}/fresh/v1/imprint/resume", json=_body(second_turn), timeout=60)
        assert off.status_code == 404
        _kill_the_store_actor(url, Path(learn_dir), _body(second_turn))
        assert httpx.delete(f"{url}/v1/imprint", timeout=60).json()["freed_bytes"] > 0  # on the restarted actor
        assert not list(Path(learn_dir).rglob("*.piece"))
    finally:
        delete_apps(["e2e-store", "e2e-fresh"])


def _kill_the_store_actor(url: str, learn_dir: Path, body: dict) -> None:
    """Ray restarts a killed store actor: the replicas' calls meanwhile wait for it (a query sent at once
    still answers), and the new process reopens the set's index and serves every stored block again."""
    import ray

    from deployments.messages.store import OpenSet, ReadRows
    from deployments.prompt_store.actor import STORE_NAMESPACE, store_actor_name

    name = store_actor_name(ray.get_runtime_context().get_node_id(), str(learn_dir))
    actor = ray.get_actor(name, namespace=STORE_NAMESPACE)
    (set_id,) = [folder.name for folder in learn_dir.iterdir() if folder.is_dir()]
    held = ray.get(actor.answer.remote(OpenSet(set_id))).blocks
    pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))
    before = httpx.post(f"{url}/v1/imprint/resume", json=body, timeout=60).json()
    ray.kill(actor, no_restart=False)
    during = httpx.post(f"{url}/v1/imprint/resume", json=body, timeout=60)
    assert during.status_code == 200, during.text
    assert ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=60) != pid  # a new process
    assert set(ray.get(actor.answer.remote(OpenSet(set_id))).blocks) == set(held)  # its index, reopened from disk
    assert ray.get(actor.answer.remote(ReadRows(set_id, held))).hashes == held  # every stored block served again
    after = httpx.post(f"{url}/v1/imprint/resume", json=body, timeout=60).json()
    assert after["disk_tokens"] == before["disk_tokens"] > 0, (before, after)
    store = httpx.get(f"{url}/health", timeout=60).json()["store"]
    on_disk = sum(path.stat().st_size for path in learn_dir.rglob("*.piece"))
    assert store["available"] is True and store["bytes_held"] == on_disk, store

"""The real renderer and engine behind the routes' Backend, in-process (no Ray), for route-level tests."""

from collections.abc import Iterator
from contextlib import contextmanager

from fastapi.testclient import TestClient

from deployments.chat_format.rendering import PromptRenderer
from deployments.config import EngineConfig
from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from serve_app.local_backend import LocalBackend

WINDOW = 160


@contextmanager
def local_backend(
    served_model: str,
    window: int = WINDOW,
    learn_dir: str | None = None,
    renderer: PromptRenderer | None = None,
    store: type | None = None,
    **engine: object,
) -> Iterator[LocalBackend]:
    """`learn_dir`: with the disk prompt-state store on, in that folder (opened in this process, by `store`:
    LocalStoreLink or a subclass); `renderer`: one built by the test (images, a template file), else the
    checkpoint's; `engine`: other EngineConfig settings."""
    from deployments.prompt_store.links import LocalStoreLink
    from deployments.scheduler.engine.core import Engine
    from deployments.scheduler.transports.thread import EngineLoop
    from serve_app.args import AppArgs

    model_dir = AppArgs(model=served_model).model_dir
    config = EngineConfig(model=str(model_dir), context=window, kv_cache_gib=0.05, device="cpu", **engine)
    if learn_dir is not None:
        config = config.model_copy(update={"learn_conversations": True, "learn_dir": learn_dir})
    engine = Engine(config, (store or LocalStoreLink)(config) if learn_dir is not None else None)
    loop = EngineLoop(engine)
    loop.start()
    try:
        yield LocalBackend(renderer or PromptRenderer.from_checkpoint(model_dir), loop)
    finally:
        loop.shutdown()


@contextmanager
def local_client(served_model: str, window: int = WINDOW, **engine: object) -> Iterator[TestClient]:
    """Every route over `local_backend`, serving the model as `tiny`."""
    with local_backend(served_model, window, **engine) as backend:
        with TestClient(build_api(backend, IngressSettings(served_name="tiny", model_ids=["tiny"]))) as client:
            yield client


def greedy_ids_over_http(served_model: str, prompt: list[int], new_tokens: int, **settings: object) -> list[int]:
    """The greedy continuation `/v1/completions` returns (end tokens ignored), over `local_client(**settings)`;
    the replica's `/health` backend is checked against `settings`' too."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    with local_client(served_model, **settings) as client:  # type: ignore[arg-type]
        reply = client.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert client.get("/health").json().get("backend") == ("mlx" if settings.get("backend") == "mlx" else None)
        return reply.json()["choices"][0]["token_ids"]

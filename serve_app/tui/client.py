"""The TUI's view of a server over HTTP: one poll of its health and figures, and a chat streamed back."""

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from serve_app.tui.readings import Readings, from_bodies

POLL_TIMEOUT_S = 5.0


@dataclass
class ServerAddress:
    """Where the server is and the key to send (read from the variable `--token-env` names, never a flag)."""

    url: str
    token: str | None = None
    token_env: str | None = None  # the variable's name, for the 401 screen's advice


class ServerClient:
    """Polls and chats over one httpx client (`transport` lets tests drive an in-process app)."""

    def __init__(self, address: ServerAddress, transport: httpx.AsyncBaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {address.token}"} if address.token else {}
        self.address = address
        self._http = httpx.AsyncClient(
            base_url=address.url.rstrip("/"), headers=headers, transport=transport, timeout=POLL_TIMEOUT_S
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def poll(self) -> Readings:
        try:
            health = await self._http.get("/health")
            if health.status_code == 503:
                return _not_serving(health)
            metrics = await self._http.get("/metrics")
            stats = await self._http.get("/stats")
        except httpx.HTTPError as exc:
            return Readings(
                state="unreachable", message=f"cannot reach {self.address.url}: {exc or type(exc).__name__}"
            )
        for reply in (health, metrics, stats):
            if reply.status_code == 401:
                return Readings(state="unauthorized", message=self._unauthorized_advice())
        if health.status_code != 200 or metrics.status_code != 200:
            failed = health if health.status_code != 200 else metrics
            return Readings(state="error", message=f"{failed.request.url.path} answered {failed.status_code}")
        return from_bodies(health.json(), metrics.text, stats.json() if stats.status_code == 200 else None)

    def _unauthorized_advice(self) -> str:
        if self.address.token:
            return f"the server refused the key in ${self.address.token_env} (401)"
        return "the server wants an API key (401): run with --token-env VAR, VAR holding the key"

    async def chat(self, model: str, prompt: str) -> AsyncIterator[str]:
        """The reply's text as it streams (reasoning included; the server's reply limit); an error is yielded
        as one line."""
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True}
        try:
            async with self._http.stream("POST", "/v1/chat/completions", json=body, timeout=None) as reply:
                if reply.status_code != 200:
                    message = json.loads(await reply.aread()).get("error", {}).get("message", "")
                    yield f"[error {reply.status_code}: {message}]"
                    return
                async for line in reply.aiter_lines():
                    text = _delta_text(line)
                    if text:
                        yield text
        except httpx.HTTPError as exc:
            yield f"[error: {exc or type(exc).__name__}]"


def _not_serving(health: httpx.Response) -> Readings:
    body = health.json()
    if body.get("status") == "loading":
        return Readings(state="loading", message=body.get("message", "loading the model"), model=body.get("model", ""))
    message = body.get("error", {}).get("message") or body.get("message") or "the model is not serving"
    return Readings(state="error", message=f"503: {message}")


def _delta_text(line: str) -> str:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return ""
    chunk = json.loads(line.removeprefix("data: "))
    if "error" in chunk:
        return f"[error: {chunk['error'].get('message', '')}]"
    delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
    return (delta.get("reasoning_content") or "") + (delta.get("content") or "")

"""A planned stop of one Ingress replica (docs/operations.md#a-planned-stop-sigterm):

1. stop admitting: every request that would start work (any method but GET, HEAD and OPTIONS) gets 503
   with `Retry-After`, in the route's own error format, and /health answers 503 "draining";
2. let the requests in flight finish, for up to the grace period (`drain_grace_s`);
3. ask every Scheduler replica to end what still runs: each reply ends as its route ends a failed one (an
   error event and `[DONE]` on a stream, a complete JSON error otherwise);
4. return, so the caller (`tensorfold serve` on SIGTERM) shuts Serve down.

`tensorfold serve` runs it on every Ingress replica (`request_drain`) before it stops Serve.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from deployments.ingress.http.limits import path_error, route_path
from deployments.messages.replies import SHUTTING_DOWN

RETRY_AFTER_S = 5  # what a refused client is told to wait: another server (or this one restarted) takes it
ENDING_WAIT_S = 5.0  # after the replicas were told to end their requests: for the error events to be written
POLL_S = 0.05
_ADMITTING_METHODS = ("GET", "HEAD", "OPTIONS")  # reads that start no work stay open while draining


class Drain:
    """One Ingress replica's stop state: whether it still admits work, and how much is in flight."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0  # requests admitted and not yet answered in full (a stream counts until [DONE])

    async def wait_idle(self, timeout_s: float) -> int:
        """Wait until nothing is in flight, or `timeout_s` has passed; returns what is still in flight."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        return self.in_flight

    async def run(self, grace_s: float, end_requests: Callable[[str], Awaitable[int]]) -> str:
        """Steps 1 to 3 of the module doc; returns one line saying how it went."""
        self.draining = True
        running = self.in_flight
        left = await self.wait_idle(grace_s)
        if not left:
            return f"drained: {running} request(s) in flight finished"
        ended = await end_requests(SHUTTING_DOWN)
        left = await self.wait_idle(ENDING_WAIT_S)
        return f"drained: {running - ended} request(s) finished, {ended} ended after {grace_s:g} s, {left} left"


class DrainMiddleware:
    """Refuses new work while the replica drains, and counts the requests in flight."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in _ADMITTING_METHODS:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            message = f"{SHUTTING_DOWN}; retry in a few seconds"
            refusal = path_error(route_path(scope), 503, "unavailable", message, {"Retry-After": str(RETRY_AFTER_S)})
            await refusal(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


def request_drain(app_name: str, grace_s: float) -> list[str]:
    """Drain every Ingress replica of `app_name` (Serve's handle broadcast); returns each replica's line.
    Needs a connected Ray driver (ray.init)."""
    from ray import serve

    handle = serve.get_deployment_handle("Ingress", app_name)
    timeout_s = grace_s + ENDING_WAIT_S + 10.0  # the replicas' own bounds, and the calls' round trips
    return list(handle.broadcast("drain", grace_s).results(timeout_s=timeout_s))

"""Calls fanned out for one request get Serve request ids of their own (deployments/ingress/backend.py)."""

import asyncio
import contextvars

from ray.serve import context as serve_context

from deployments.engine_client.fan_out import fan_out

LABEL = contextvars.ContextVar("label", default="")


def test_fanned_out_calls_leave_the_serve_request_behind_and_keep_the_rest() -> None:
    async def seen() -> tuple[object, str]:
        return serve_context._serve_request_context.get(), LABEL.get()

    async def request() -> list:
        serve_context._serve_request_context.set(
            serve_context._RequestContext(request_id="r1", _internal_request_id="i1")
        )
        LABEL.set("key-a")
        results = await fan_out([seen(), seen()])
        assert serve_context._get_serve_request_context().request_id == "r1"  # the request's own stays
        return results

    assert asyncio.run(request()) == [(None, "key-a"), (None, "key-a")]


def test_a_failure_comes_back_as_its_exception() -> None:
    async def fails() -> None:
        raise ValueError("no")

    async def fine() -> int:
        return 1

    results = asyncio.run(fan_out([fails(), fine()]))
    assert isinstance(results[0], ValueError) and results[1] == 1

"""Calls into the graph made side by side from inside one Serve request (a route's, or a Slide change's)."""

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any, TypeVar

from ray.serve import context as serve_context

T = TypeVar("T")


async def fan_out(coroutines: list[Coroutine[Any, Any, T]]) -> list[T | BaseException]:
    """Run calls into the graph side by side, each in a context of its own, and return every result (or
    its exception). Inside one request Serve gives every call that request's id, and its router, keeping
    pending calls by id, then routes them one at a time with backoffs (or loses them): concurrent calls made
    for one request need ids of their own."""
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(coroutine, context=_without_serve_request()) for coroutine in coroutines]
    return await asyncio.gather(*tasks, return_exceptions=True)


def _without_serve_request() -> contextvars.Context:
    """This context (the API key's label and the rest) without Serve's request: a call made in it gets ids
    of its own. Serve keeps the request in a private variable of Ray 2.60's (`ray.serve.context`)."""
    context = contextvars.copy_context()
    context.run(serve_context._serve_request_context.set, None)
    return context

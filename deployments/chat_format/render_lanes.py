"""Where the Renderer's work runs: off the event loop, in two bounded pools of threads by size.

Rendering and tokenising a prompt of megabytes takes seconds of CPU. Done on the event loop (or with the
GIL held, as `Tokenizer.encode` does) it stalls every other request; done in one shared pool, small
requests queue behind large ones. So work on large inputs (`LARGE_CHARS` or more, the size at which the
window is also checked before tokenising: deployments/messages/window.py) runs in a pool of `LARGE_WORKERS`
threads and everything else in its own pool: large requests wait for each other, never small ones, and long
texts are tokenised with the GIL released (deployments/tokenizer.py).
"""

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from deployments.messages.window import LARGE_CHARS, text_chars

T = TypeVar("T")
LARGE_WORKERS = 2  # large requests tokenised at once, per replica
SMALL_WORKERS = 8


class RenderLanes:
    """Two bounded thread pools, one for large inputs and one for the rest (one pair per renderer)."""

    def __init__(self, large_workers: int = LARGE_WORKERS, small_workers: int = SMALL_WORKERS) -> None:
        self._large = ThreadPoolExecutor(large_workers, thread_name_prefix="render-large")
        self._small = ThreadPoolExecutor(small_workers, thread_name_prefix="render-small")

    async def run(self, chars: int, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` in the lane for an input of `chars` characters."""
        pool = self._large if chars >= LARGE_CHARS else self._small
        return await asyncio.get_running_loop().run_in_executor(pool, work, *args)

    def shutdown(self) -> None:
        self._large.shutdown(wait=False, cancel_futures=True)
        self._small.shutdown(wait=False, cancel_futures=True)


class LanedRendering:
    """The Renderer's calls, each in its lane: shared by the Renderer deployment and the in-process backend,
    which set `_renderer` (a PromptRenderer) and `_lanes`."""

    _renderer: Any
    _lanes: RenderLanes

    async def render_chat(self, request: Any) -> Any:
        """A `RenderedPrompt`, or the `Refusal` a client's error becomes."""
        chars = text_chars(request.messages) + text_chars(request.tools)
        return await self._lanes.run(chars, self._renderer.render_or_refuse, request)

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self._lanes.run(len(text), self._renderer.tokenize, text, add_special_tokens)

    async def token_strs(self, ids: list[int]) -> list[str]:
        return await self._lanes.run(len(ids), self._renderer.token_strs, ids)

    async def detokenize(self, ids: list[int]) -> str:
        return await self._lanes.run(len(ids), self._renderer.detokenize, ids)

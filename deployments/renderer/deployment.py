"""The Renderer deployment: a thin Serve wrapper over ChatPromptRenderer (chat template, tokenizer, images).

Errors a client caused (a template refusal, a malformed message, an image it will not read, a prompt too
large for the window) come back as `Refusal` values naming `messages` or the image's field, rather than
exceptions, so Ingress can answer 400 without unwrapping Ray's exception types. Rendering, tokenising and
fetching image URLs run off the replica's event loop, large inputs in their own bounded pool
(deployments/chat_format/render_lanes.py), so a megabyte prompt never holds up a small one.
"""

from ray import serve

from deployments.chat_format.render_lanes import RenderLanes, text_chars
from deployments.chat_format.rendering import RendererOptions
from deployments.config import ImageSettings
from deployments.messages.render import ChatRenderRequest, RenderedPrompt, TokenizerCard
from deployments.messages.replies import Refusal
from deployments.renderer.chat_prompts import ChatPromptRenderer
from deployments.serve_sockets import configure_serve_sockets


@serve.deployment(name="Renderer", ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=256)
class Renderer:
    def __init__(
        self, checkpoint_dir: str, options: RendererOptions | None = None, images: ImageSettings | None = None
    ) -> None:
        configure_serve_sockets()  # before Serve binds this replica's gRPC server
        self._renderer = ChatPromptRenderer.open(checkpoint_dir, options, images)
        self._lanes = RenderLanes()

    def card(self) -> TokenizerCard:
        return self._renderer.card()

    async def render_chat(self, request: ChatRenderRequest) -> RenderedPrompt | Refusal:
        chars = text_chars(request.messages) + text_chars(request.tools)
        return await self._lanes.run(chars, self._renderer.render_or_refuse, request)

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self._lanes.run(len(text), self._renderer.tokenize, text, add_special_tokens)

    async def token_strs(self, ids: list[int]) -> list[str]:
        return await self._lanes.run(len(ids), self._renderer.token_strs, ids)

    async def detokenize(self, ids: list[int]) -> str:
        return await self._lanes.run(len(ids), self._renderer.detokenize, ids)

"""The Renderer deployment: a thin Serve wrapper over ChatPromptRenderer (chat template, tokenizer, images).

Errors a client caused (a template refusal, a malformed message, an image it will not read) come back as
`Refusal` values naming `messages` or the image's field, rather than exceptions, so Ingress can answer 400
without unwrapping Ray's exception types. Image URLs are fetched here, off Ingress's event loop.
"""

from ray import serve

from deployments.chat_format.conversation import MessageError
from deployments.chat_format.rendering import RendererOptions
from deployments.chat_format.template import TemplateRenderError
from deployments.config import ImageSettings
from deployments.messages.render import ChatRenderRequest, RenderedPrompt, TokenizerCard
from deployments.messages.replies import Refusal
from deployments.renderer.chat_prompts import ChatPromptRenderer, render_refusal


@serve.deployment(name="Renderer", ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=256)
class Renderer:
    def __init__(
        self, checkpoint_dir: str, options: RendererOptions | None = None, images: ImageSettings | None = None
    ) -> None:
        self._renderer = ChatPromptRenderer.open(checkpoint_dir, options, images)

    def card(self) -> TokenizerCard:
        return self._renderer.card()

    def render_chat(self, request: ChatRenderRequest) -> RenderedPrompt | Refusal:
        try:
            return self._renderer.render_chat(request)
        except (TemplateRenderError, MessageError) as exc:
            return render_refusal(exc)

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._renderer.tokenize(text, add_special_tokens)

    def token_strs(self, ids: list[int]) -> list[str]:
        return self._renderer.token_strs(ids)

    def detokenize(self, ids: list[int]) -> str:
        return self._renderer.detokenize(ids)

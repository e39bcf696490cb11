"""The Renderer deployment: a thin Serve wrapper over PromptRenderer (chat template + tokenizer).

Errors a client caused (a template refusal, a malformed message) come back as `Refusal` values naming
`messages`, rather than exceptions, so Ingress can answer 400 without unwrapping Ray's exception types.
"""

from ray import serve

from deployments.chat_format.conversation import MessageError
from deployments.chat_format.rendering import PromptRenderer, RendererOptions
from deployments.chat_format.template import TemplateRenderError
from deployments.messages.render import ChatRenderRequest, RenderedPrompt, TokenizerCard
from deployments.messages.replies import Refusal
from deployments.serve_sockets import configure_serve_sockets


@serve.deployment(name="Renderer", ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=256)
class Renderer:
    def __init__(self, checkpoint_dir: str, options: RendererOptions | None = None) -> None:
        configure_serve_sockets()  # before Serve binds this replica's gRPC server
        self._renderer = PromptRenderer.from_checkpoint(checkpoint_dir, options)

    def card(self) -> TokenizerCard:
        return self._renderer.card()

    def render_chat(self, request: ChatRenderRequest) -> RenderedPrompt | Refusal:
        try:
            return self._renderer.render_chat(request)
        except (TemplateRenderError, MessageError) as exc:
            return Refusal(str(exc), param="messages")

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._renderer.tokenize(text, add_special_tokens)

    def token_strs(self, ids: list[int]) -> list[str]:
        return self._renderer.token_strs(ids)

    def detokenize(self, ids: list[int]) -> str:
        return self._renderer.detokenize(ids)

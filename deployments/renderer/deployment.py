"""The Renderer deployment: a thin Serve wrapper over ChatPromptRenderer (chat template, tokenizer, images).

Errors a client caused (a template refusal, a malformed message, an image it will not read, a prompt too
large for the window) come back as `Refusal` values naming `messages` or the image's field, rather than
exceptions, so Ingress can answer 400 without unwrapping Ray's exception types. Rendering, tokenising and
fetching image URLs run off the replica's event loop, large inputs in their own bounded pool
(deployments/chat_format/render_lanes.py), so a megabyte prompt never holds up a small one.
"""

from ray import serve

from deployments.chat_format.render_lanes import LanedRendering, RenderLanes
from deployments.chat_format.rendering import RendererOptions
from deployments.config import ImageSettings
from deployments.messages.render import TokenizerCard
from deployments.renderer.chat_prompts import ChatPromptRenderer
from deployments.serve_sockets import configure_serve_sockets


@serve.deployment(name="Renderer", ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=256)
class Renderer(LanedRendering):
    def __init__(
        self, checkpoint_dir: str, options: RendererOptions | None = None, images: ImageSettings | None = None
    ) -> None:
        configure_serve_sockets()  # before Serve binds this replica's gRPC server
        self._renderer = ChatPromptRenderer.open(checkpoint_dir, options, images)
        self._lanes = RenderLanes()

    def card(self) -> TokenizerCard:
        return self._renderer.card()

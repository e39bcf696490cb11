"""The Renderer's prompt logic: the chat template and tokenizer (PromptRenderer) with image input around it.

Images are read before the template renders (refusals first, then bytes, decoding and patches); the
rendered ids then get each image's placeholders expanded (docs/vision.md).
"""

from dataclasses import replace
from pathlib import Path

from deployments.chat_format.rendering import PromptRenderer, RendererOptions
from deployments.config import ImageSettings
from deployments.messages.render import ChatRenderRequest, RenderedPrompt, TokenizerCard
from deployments.renderer.vision.preprocess import Preprocessing
from deployments.renderer.vision.reader import IMAGE_PAD, ImageReader, has_vision_tower
from deployments.tokenizer import TokenizerBundle, load_tokenizer


class ChatPromptRenderer(PromptRenderer):
    """PromptRenderer plus the checkpoint's image input (one per Renderer replica)."""

    def __init__(self, bundle: TokenizerBundle, options: RendererOptions | None, images: ImageReader) -> None:
        super().__init__(bundle, options)
        self.images = images

    @classmethod
    def open(
        cls, checkpoint_dir: str | Path, options: RendererOptions | None = None, settings: ImageSettings | None = None
    ) -> "ChatPromptRenderer":
        """The checkpoint's tokenizer and template, and its preprocessor config where it has a vision tower."""
        bundle = load_tokenizer(checkpoint_dir)
        prep = Preprocessing.read(checkpoint_dir) if has_vision_tower(checkpoint_dir) else None
        reader = ImageReader(settings or ImageSettings(), prep, bundle.token_to_id(IMAGE_PAD))
        return cls(bundle, options, reader)

    def card(self) -> TokenizerCard:
        return replace(super().card(), vision=self.images.enabled)

    def render_chat(self, request: ChatRenderRequest) -> RenderedPrompt:
        """Prompt ids with every image's placeholders expanded, and the images; ImageRefusal for a bad part."""
        messages, images = self.images.read(request.messages)
        rendered = super().render_chat(replace(request, messages=messages))
        if not images:
            return rendered
        ids, placed = self.images.place(rendered.prompt_token_ids, images)
        return replace(rendered, prompt_token_ids=ids, images=placed)

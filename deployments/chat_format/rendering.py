"""The Renderer's pure logic: chat requests to prompt ids, plus tokenize/detokenize (testable without Ray).

The Renderer keeps no per-request state; what it returns is plain dataclasses that travel through Ray.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deployments.chat_format.conversation import (
    MessageError,
    demote_later_system,
    has_later_system,
    normalise_messages,
)
from deployments.chat_format.effort import template_kwargs, template_levels
from deployments.chat_format.markups import markup_for_template
from deployments.chat_format.template import ChatTemplate, TemplateRenderError
from deployments.chat_format.think import think_for_template
from deployments.messages.render import ChatRenderRequest, RenderedPrompt, ReplyFormat, TokenizerCard
from deployments.messages.replies import Refusal
from deployments.messages.window import text_past_window
from deployments.tokenizer import TokenizerBundle, load_tokenizer


class PromptPastWindow(Exception):
    """A rendered prompt whose size proves it cannot fit the window; carries the refusal."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


@dataclass
class RendererOptions:
    """Server-wide rendering settings (from the startup flags)."""

    chat_template: str | None = None  # --chat-template's text; None: the checkpoint's; "": no chat rendering
    reasoning_effort: str | None = None  # --reasoning-effort: the effort of requests that set none
    clear_thinking: bool = field(default_factory=lambda: os.environ.get("TF_GLM_CLEAR_THINKING") == "1")


class PromptRenderer:
    """A checkpoint's tokenizer and chat template (one per Renderer replica)."""

    def __init__(self, bundle: TokenizerBundle, options: RendererOptions | None = None) -> None:
        self.bundle = bundle
        self.options = options or RendererOptions()
        specials = {"bos_token": bundle.bos_token, "eos_token": bundle.eos_token, "pad_token": bundle.pad_token}
        specials = {k: v for k, v in specials.items() if v is not None}
        # A --chat-template file replaces the checkpoint's; an empty one leaves chat rendering unavailable.
        source = bundle.chat_template if self.options.chat_template is None else self.options.chat_template
        self.template = ChatTemplate(source, specials) if source else None
        self._levels = template_levels(source)
        markup = markup_for_template(source)
        self._tool_format = markup.name if markup else None
        self._clears_thinking = bool(source) and "clear_thinking" in source
        self.think = think_for_template(source)
        self._opener_id = bundle.token_to_id(self.think.opener)
        self._closer_id = bundle.token_to_id(self.think.closer)
        self._close_ids = bundle.encode(self.think.forced_close, add_special_tokens=False)
        self._max_token_bytes = bundle.max_token_bytes  # read over the vocabulary once, at load

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, options: RendererOptions | None = None) -> "PromptRenderer":
        return cls(load_tokenizer(checkpoint_dir), options)

    def card(self) -> TokenizerCard:
        return TokenizerCard(
            vocab_size=self.bundle.vocab_size,
            eos_token_ids=list(self.bundle.eos_token_ids),
            has_chat_template=self.template is not None,
            max_token_bytes=self._max_token_bytes,
        )

    def render_or_refuse(self, request: ChatRenderRequest) -> RenderedPrompt | Refusal:
        """`render_chat`, with what the client caused (template, message, window) as a Refusal value."""
        try:
            return self.render_chat(request)
        except (TemplateRenderError, MessageError) as exc:  # an image part's error names its field
            return Refusal(str(exc), param=getattr(exc, "param", None) or "messages")
        except PromptPastWindow as exc:
            return exc.refusal

    def render_chat(self, request: ChatRenderRequest) -> RenderedPrompt:
        """Prompt ids exactly as the chat route runs them; raises TemplateRenderError/MessageError (HTTP 400),
        or PromptPastWindow before tokenising a prompt too large for `request.window`."""
        text, kwargs = self.render_text(request)
        too_long = text_past_window(text, self._max_token_bytes, request.window, "messages")
        if too_long is not None:
            raise PromptPastWindow(too_long)
        ids = self.bundle.encode(text, add_special_tokens=False)  # the template wrote the special tokens
        enable = kwargs.get("enable_thinking")
        reply = ReplyFormat(
            think_opener_id=self._opener_id,
            think_closer_id=self._closer_id,
            prompt_opens_thinking=self.think.prompt_opens(text),
            enable_thinking=enable if isinstance(enable, bool) else None,
            prompt_closes_thinking=self.think.prompt_closes(text),
            tool_format=self._tool_format,
            think_close_ids=list(self._close_ids),
            reasoning_effort=kwargs.get("reasoning_effort"),
            think_format=self.think.name,
        )
        return RenderedPrompt(prompt_token_ids=ids, reply=reply)

    def render_text(self, request: ChatRenderRequest) -> tuple[str, dict[str, Any]]:
        if self.template is None:
            raise TemplateRenderError("this model has no chat template; use /v1/completions with a raw prompt")
        messages = normalise_messages(request.messages)
        kwargs = template_kwargs(
            request.chat_template_kwargs, request.reasoning_effort, self.options.reasoning_effort, self._levels
        )
        if self._clears_thinking and "clear_thinking" not in kwargs:
            kwargs["clear_thinking"] = self.options.clear_thinking  # keep earlier reasoning unless asked
        try:
            text = self.template.render(messages, request.tools, request.add_generation_prompt, kwargs)
        except TemplateRenderError:
            if not has_later_system(messages):
                raise
            # Templates that only accept a leading system message get later ones as user messages.
            text = self.template.render(
                demote_later_system(messages), request.tools, request.add_generation_prompt, kwargs
            )
        return text, kwargs

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.bundle.encode(text, add_special_tokens=add_special_tokens)

    def token_strs(self, ids: list[int]) -> list[str]:
        return [self.bundle.tokenizer.id_to_token(i) or "" for i in ids]

    def detokenize(self, ids: list[int]) -> str:
        return self.bundle.decode(ids, skip_special_tokens=False)

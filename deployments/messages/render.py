"""What Ingress asks the Renderer and what comes back: the chat request, the prompt ids, the reply format."""

from dataclasses import dataclass, field
from typing import Any

from deployments.messages.images import ImageInput


@dataclass
class ChatRenderRequest:
    """What shapes a chat prompt (set by Ingress from the route's body)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    reasoning_effort: str | None = None  # the request's top-level field (validated by Ingress)
    # The engine's window, where the request is refused past it: a rendered prompt whose size alone proves
    # it fills the window is refused before it is tokenised. None: tokenise whatever the size (/tokenize).
    window: int | None = None


@dataclass
class ReplyFormat:
    """What the reply parser and usage need to know about the reply this prompt asks for."""

    think_opener_id: int | None = None  # the think opener (`<think>`), when the vocabulary has it as one id
    think_closer_id: int | None = None  # the think closer (`</think>`)
    prompt_opens_thinking: bool = False  # the rendered prompt ends inside an open think block
    enable_thinking: bool | None = None  # the toggle the template heard, if the request set one
    prompt_closes_thinking: bool = False  # the prompt ends with a closed (empty) think block: thinking off
    tool_format: str | None = None  # the name of the call markup family the template teaches (chat_format.markups)
    think_close_ids: list[int] = field(default_factory=list)  # "\n</think>\n\n": a forced close of the block
    reasoning_effort: str | None = None  # the level the template heard
    think_format: str = "think"  # the name of the think markup family the template writes (chat_format.think)


@dataclass
class RenderedPrompt:
    """What crosses back to Ingress: the ids (the text stays here; long prompts would double the payload)."""

    prompt_token_ids: list[int]
    reply: ReplyFormat
    images: list[ImageInput] = field(default_factory=list)  # in prompt order, placeholders expanded


@dataclass
class TokenizerCard:
    """Facts about the tokenizer Ingress checks requests against (asked once per Ingress replica)."""

    vocab_size: int
    eos_token_ids: list[int]
    has_chat_template: bool
    max_token_bytes: int  # a text of B bytes holds at least ceil(B / this) tokens (TokenizerBundle's)
    vision: bool = False  # the Renderer reads image parts (--vision on a checkpoint with a vision tower)

"""The context window: the rule every request is held to, and the words of its refusal (docs/api.md, The window).

A request fits when its prompt leaves room for a reply token and its explicit reply limit, if any, fits
beside the prompt. It is checked as early as each fact is known, by the same rule and the same words:

1. before rendering, a conversation's message count (every template spends at least a token per message),
   asked only of long conversations: short ones render quickly anyway (Ingress, `messages_past_window`);
2. before tokenising, a text's bytes (B bytes hold at least B / max_token_bytes tokens), asked for the window
   only for a large input: a small one tokenises quickly anyway (Ingress and the Renderer, `text_past_window`);
3. after tokenising, the prompt's ids and the reply limit (the engine's admission; Ingress where it answers
   from the count alone: `/v1/messages/count_tokens`, the imprint routes, a decision's question).

Every refusal is a 400 with code `context_length_exceeded` naming the prompt's field. Plain values only:
Ingress, the Renderer and the Scheduler all import this.
"""

import math
from typing import Any

from deployments.messages.replies import Refusal

CODE = "context_length_exceeded"
CHEAP_RENDER_MESSAGES = 256  # conversations up to this long are rendered without asking for the window
# Characters of text in a request: about 10 ms of tokenising on one core. An input this large waits for the
# window to be checked before it is tokenised, and is rendered in its own lane (chat_format/render_lanes.py).
LARGE_CHARS = 64 << 10


def text_chars(value: Any) -> int:
    """The characters of every string in a JSON-like value (keys included), walked without recursion."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def min_tokens(text: str, max_token_bytes: int) -> int:
    """The fewest tokens `text` can encode to, from its size alone (no tokenising): `max_token_bytes` is the
    tokenizer's (TokenizerBundle.max_token_bytes, TokenizerCard's)."""
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / max_token_bytes)


def counts_messages_first(messages: int) -> bool:
    """Whether a conversation this long is checked against the window before it is rendered."""
    return messages > CHEAP_RENDER_MESSAGES


def measures_text_first(chars: int) -> bool:
    """Whether an input this large waits for the window, to be checked before it is tokenised."""
    return chars >= LARGE_CHARS


def _refusal(window: int, detail: str, advice: str, param: str) -> Refusal:
    message = f"This server's maximum context length is {window} tokens. However, {detail}. {advice}"
    return Refusal(message, param, CODE)


def messages_past_window(messages: int, window: int, param: str) -> Refusal | None:
    """A conversation with more messages than the window has tokens (no template renders one in fewer)."""
    if messages <= window:
        return None
    detail = f"your conversation has {messages} messages, at least a token each"
    return _refusal(window, detail, "Please send fewer messages.", param)


def text_past_window(text: str, max_token_bytes: int, window: int | None, param: str) -> Refusal | None:
    """A text whose byte count alone proves it fills `window` (None: the window is not asked yet)."""
    if window is None:
        return None
    at_least = min_tokens(text, max_token_bytes)
    if at_least < window:
        return None
    detail = f"your prompt has at least {at_least} tokens, which leaves no room for a reply"
    return _refusal(window, detail, "Please shorten the prompt.", param)


def prompt_past_window(window: int, prompt_tokens: int, param: str) -> Refusal | None:
    """A prompt that leaves no room for a reply token."""
    if prompt_tokens < window:
        return None
    detail = f"your prompt has {prompt_tokens} tokens, which leaves no room for a reply"
    return _refusal(window, detail, "Please shorten the prompt or reduce the reply limit.", param)


def reply_past_window(window: int, prompt_tokens: int, reply_limit: int | None, param: str) -> Refusal | None:
    """An explicit reply limit that does not fit beside the prompt (None: no limit asked, none to refuse)."""
    if reply_limit is None or prompt_tokens + reply_limit <= window:
        return None
    detail = (
        f"you requested {prompt_tokens + reply_limit} tokens "
        f"({prompt_tokens} in the prompt, {reply_limit} for the reply)"
    )
    return _refusal(window, detail, "Please shorten the prompt or reduce the reply limit.", param)


def tokens_past_window(window: int, prompt_tokens: int, reply_limit: int | None, param: str) -> Refusal | None:
    """The prompt, then its reply limit, as the engine's admission holds them to the window."""
    return prompt_past_window(window, prompt_tokens, param) or reply_past_window(
        window, prompt_tokens, reply_limit, param
    )

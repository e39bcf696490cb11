"""Asking the served model the way a learn does: one user message through the chat template with thinking
off, greedy decoding, at a named pocket version (None: the current one); the reply's content is what a chat
completion's message shows.

With thinking off the template's reply opens no think block, so a request here needs neither the engine's
watch over one nor a grammar gated after one (deployments/ingress/chat_run.py gates a chat's).
"""

import asyncio
from dataclasses import dataclass

from deployments.chat_format.reply_parser import ReplyParser, ReplyReader
from deployments.engine_client.engine_reply import EngineReply
from deployments.engine_client.fan_out import fan_out
from deployments.messages.render import ChatRenderRequest, ReplyFormat
from deployments.messages.replies import Refusal
from deployments.messages.requests import EngineRequest, GrammarSpec, SamplingParams, new_request_id
from deployments.slide.context import SlideContext, SlideRefused, bad_request

THINKING_OFF = {"enable_thinking": False}
ASKED_AT_ONCE = 8


@dataclass
class Prompt:
    """A one-user-message chat, rendered with thinking off."""

    text: str
    ids: list[int]
    reply: ReplyFormat


@dataclass
class Reply:
    """A greedy reply: its token ids, its content (what a chat completion's message shows) and version."""

    token_ids: list[int]
    content: str
    finish: str
    version: int


async def rendered(ctx: SlideContext, text: str, thinking_off: bool = True) -> Prompt | Refusal:
    """`text` as the user's message (thinking off, or as the template has it), or the Renderer's refusal
    (the window's among them)."""
    kwargs = dict(THINKING_OFF) if thinking_off else {}
    request = ChatRenderRequest(messages=[{"role": "user", "content": text}], chat_template_kwargs=kwargs)
    request.window = await ctx.window()
    prompt = await ctx.links.render_chat(request)
    if isinstance(prompt, Refusal):
        return prompt
    return Prompt(text, prompt.prompt_token_ids, prompt.reply)


async def render_prompt(ctx: SlideContext, text: str, param: str, thinking_off: bool = True) -> Prompt:
    """`text` rendered as a question; a prompt the template or the window refuses is a 400 naming `param`."""
    window = await ctx.window()
    prompt = await rendered(ctx, text, thinking_off)
    if isinstance(prompt, Refusal):
        raise bad_request(f"{param}: {prompt.message}", param, prompt.code)
    if thinking_off and prompt.reply.prompt_opens_thinking:  # the answer would be reasoning, not content
        raise bad_request(f"{param}: this model's chat template cannot turn thinking off", param)
    if len(prompt.ids) >= window:
        raise bad_request(
            f"{param}: the question's prompt has {len(prompt.ids)} tokens, filling this server's {window}-token window",
            param,
            "context_length_exceeded",
        )
    return prompt


async def reply_to(ctx: SlideContext, request: EngineRequest, prompt: Prompt) -> Reply:
    """The whole reply to `request` (its prompt `prompt`'s ids); the engine's refusal is raised as one."""
    reply = EngineReply(ctx.links.stream, request)
    refused = await reply.open()
    if refused is not None:
        raise SlideRefused(refused)
    text, _ = await reply.collect()
    assert reply.stats is not None and reply.finish_reason is not None
    card = await ctx.links.card()
    reader = ReplyReader(ReplyParser(prompt.reply), set(card.eos_token_ids))
    content = reader.whole(text, reply.finish_reason, reply.token_ids).content
    return Reply(list(reply.token_ids), content, reply.finish_reason, reply.stats.pocket_version)


async def greedy_request(
    ctx: SlideContext,
    prefix: str,
    prompt: Prompt,
    max_tokens: int,
    *,
    version: int | None = None,
    key_label: str = "none",
    grammar: GrammarSpec | None = None,
) -> EngineRequest:
    """A greedy request for `prompt` at pocket `version`, at most `max_tokens` (and the window) long."""
    return EngineRequest(
        request_id=new_request_id(prefix),
        prompt_token_ids=list(prompt.ids),
        sampling=SamplingParams(temperature=0.0),
        max_tokens=max(1, min(max_tokens, await ctx.window() - len(prompt.ids))),
        key_label=key_label,
        grammar=grammar,
        pocket_version=version,
    )


async def ask(ctx: SlideContext, prompt: Prompt, version: int | None, max_tokens: int) -> Reply:
    """The greedy reply to `prompt` at pocket `version`, at most `max_tokens` (and the window) long."""
    request = await greedy_request(ctx, "slidecheck", prompt, max_tokens, version=version)
    return await reply_to(ctx, request, prompt)


async def ask_all(ctx: SlideContext, asked: list[tuple[Prompt, int]], version: int | None) -> list[Reply]:
    """Every (prompt, max_tokens), ASKED_AT_ONCE at a time: batched, they answer as they would alone; a
    learn's forty-odd checks sent at once would crowd Serve's router for every other request."""
    lane = asyncio.Semaphore(ASKED_AT_ONCE)

    async def one(prompt: Prompt, limit: int) -> Reply:
        async with lane:
            return await ask(ctx, prompt, version, limit)

    results = await fan_out([one(prompt, limit) for prompt, limit in asked])
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        raise failure
    return [r for r in results if isinstance(r, Reply)]

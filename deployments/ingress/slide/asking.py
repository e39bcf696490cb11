"""Asking the served model a question the way a learn checks it: one user message through the chat template
with thinking off, greedy decoding, at a named pocket version (None: the current one)."""

import asyncio
from dataclasses import dataclass

from deployments.chat_format.reply_parser import ReplyParser
from deployments.ingress.backend import fan_out
from deployments.ingress.context import ServingContext
from deployments.ingress.engine_request import new_request_id
from deployments.ingress.generation import Generation
from deployments.ingress.http.errors import bad_request
from deployments.ingress.reply_reader import ReplyReader
from deployments.messages.render import ChatRenderRequest, ReplyFormat
from deployments.messages.replies import Refusal
from deployments.messages.requests import EngineRequest, SamplingParams

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


async def render_prompt(ctx: ServingContext, text: str, param: str, thinking_off: bool = True) -> Prompt:
    """`text` as the user's message (thinking off, or as the template has it); a prompt the template or the
    window refuses is a 400 naming `param`."""
    window = (await ctx.facts()).window
    kwargs = dict(THINKING_OFF) if thinking_off else {}
    request = ChatRenderRequest(messages=[{"role": "user", "content": text}], chat_template_kwargs=kwargs)
    request.window = window
    rendered = await ctx.backend.render_chat(request)
    if isinstance(rendered, Refusal):
        raise bad_request(f"{param}: {rendered.message}", param, rendered.code)
    if thinking_off and rendered.reply.prompt_opens_thinking:  # the answer would be reasoning, not content
        raise bad_request(f"{param}: this model's chat template cannot turn thinking off", param)
    if len(rendered.prompt_token_ids) >= window:
        raise bad_request(
            f"{param}: the question's prompt has {len(rendered.prompt_token_ids)} tokens, filling this server's "
            f"{window}-token window",
            param,
            "context_length_exceeded",
        )
    return Prompt(text, rendered.prompt_token_ids, rendered.reply)


async def ask(ctx: ServingContext, prompt: Prompt, version: int | None, max_tokens: int) -> Reply:
    """The greedy reply to `prompt` at pocket `version`, at most `max_tokens` (and the window) long."""
    facts = await ctx.facts()
    card = await ctx.backend.card()
    request = EngineRequest(
        request_id=new_request_id("slidecheck"),
        prompt_token_ids=list(prompt.ids),
        sampling=SamplingParams(temperature=0.0),
        max_tokens=max(1, min(max_tokens, facts.window - len(prompt.ids))),
        pocket_version=version,
    )
    generation = Generation(ctx.backend, request, prompt.reply, facts.engine)
    await generation.start()
    text, _ = await generation.collect()
    assert generation.summary is not None and generation.finish_reason is not None
    reader = ReplyReader(ReplyParser(prompt.reply), set(card.eos_token_ids))
    content = reader.whole(text, generation.finish_reason, generation.token_ids).content
    stats = generation.summary.stats
    return Reply(list(generation.token_ids), content, generation.finish_reason, stats.pocket_version)


async def ask_all(ctx: ServingContext, asked: list[tuple[Prompt, int]], version: int | None) -> list[Reply]:
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

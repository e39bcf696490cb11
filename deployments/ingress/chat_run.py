"""The one chat handler every chat-shaped API family runs: render, build the request (with the grammar the
reply runs under once rendered: the body's, or a forced tool call's gated after thinking), start it.

Chat completions parse the client's body into a ChatCompletionRequest; Messages and Responses build one
from their own typed bodies (deployments/ingress/chat_request.py). Either way the prompt, the EngineRequest
and hence the reply tokens are the ones the equivalent chat completion gets; only the framing differs.
"""

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

from deployments.chat_format.reply_parser import ReplyParser, ReplyReader
from deployments.ingress.chat_request import ChatCompletionRequest
from deployments.ingress.context import ServingContext
from deployments.ingress.engine_request import ReplyAsks, engine_request, thinking_controls
from deployments.ingress.generation import Generation
from deployments.ingress.http.errors import bad_request, refusal_error
from deployments.ingress.http.sse import counting_departures
from deployments.messages.render import ChatRenderRequest, RenderedPrompt, ReplyFormat
from deployments.messages.replies import Refusal
from deployments.messages.requests import GrammarSpec
from deployments.messages.window import text_chars, text_past_window


@dataclass
class ChatRun:
    """One started chat reply (set by `start_chat`): what each family's framer reads."""

    fields: ChatCompletionRequest  # the validated chat body
    generation: Generation  # started: a refusal was already raised as an APIError
    parser: ReplyParser  # reads the reply for its template and the tools offered
    end_token_ids: set[int]  # the ids that end the reply (EOS and the request's stop ids)
    prompt_token_ids: list[int]

    def reader(self) -> ReplyReader:
        """A fresh parsing state for the reply's text."""
        return ReplyReader(self.parser, self.end_token_ids)


class ChatPrompt(Protocol):
    """What renders a chat prompt: a chat completion's fields, or /tokenize's given messages."""

    @property
    def messages(self) -> list[dict[str, Any]] | None: ...

    @property
    def offered_tools(self) -> list[dict[str, Any]] | None: ...

    @property
    def chat_template_kwargs(self) -> dict[str, Any]: ...

    @property
    def add_generation_prompt(self) -> bool | None: ...

    @property
    def reasoning_effort(self) -> str | None: ...


async def render_chat_body(ctx: ServingContext, fields: ChatPrompt) -> RenderedPrompt:
    """The prompt a chat body renders to (also what count_tokens and /tokenize answer); a refusal is a 400,
    a prompt past the window among them: one whose size proves it is refused before it is tokenised."""
    too_many = await ctx.messages_past_window(fields.messages)  # before rendering them
    if too_many is not None:
        raise refusal_error(too_many)
    render = ChatRenderRequest(
        messages=fields.messages or [],
        tools=fields.offered_tools,  # tool_choice "none" hides them from the template and the parser
        chat_template_kwargs=fields.chat_template_kwargs,
        add_generation_prompt=fields.add_generation_prompt is not False,
        reasoning_effort=fields.reasoning_effort,
        window=await ctx.window_for(text_chars(fields.messages) + text_chars(fields.offered_tools)),
    )
    rendered = await ctx.backend.render_chat(render)
    if isinstance(rendered, Refusal):
        raise refusal_error(rendered)
    return rendered


def counted_stream(ctx: ServingContext, generation: Generation, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A reply stream whose client, leaving before all of it went out, is counted as a disconnection
    (`client_disconnections_total`) by this replica, once, whether or not the reply had finished upstream
    (its request is `streamed`, so the engine does not count its abort too)."""
    return counting_departures(body, ctx.backend.client_left)


async def tokenize_prompt(ctx: ServingContext, text: str, add_special_tokens: bool) -> list[int]:
    """A raw prompt's ids (completions, /tokenize); one whose size proves it fills the window is a 400
    naming `prompt` before it is tokenised."""
    card = await ctx.backend.card()
    too_long = text_past_window(text, card.max_token_bytes, await ctx.window_for(len(text)), "prompt")
    if too_long is not None:
        raise refusal_error(too_long)
    return await ctx.backend.tokenize(text, add_special_tokens)


async def start_chat(
    ctx: ServingContext, fields: ChatCompletionRequest, request_id: str, arrival: float, streamed: bool = False
) -> ChatRun:
    """Render a chat body, then start its generation; every refusal is an APIError first (`streamed`: the
    reply goes out as a stream, through `counted_stream`)."""
    rendered = await render_chat_body(ctx, fields)
    card = await ctx.backend.card()
    settings = ctx.settings
    asks = ReplyAsks(
        grammar=reply_grammar(fields, rendered.reply),
        logprobs=fields.logprob_top,
        thinking=thinking_controls(
            rendered.reply, fields.thinking_budget, settings.thinking_budget, settings.loop_guard
        ),
        images=rendered.images,
        streamed=streamed,
    )
    request = engine_request(fields, request_id, rendered.prompt_token_ids, "messages", card, arrival, asks)
    facts = await ctx.facts()  # valid and rendered: a request sent while the model loads waits for it here
    generation = Generation(ctx.backend, request, rendered.reply, facts.engine)
    parallel = fields.parallel_tool_calls is not False
    parser = ReplyParser(rendered.reply, fields.offered_tools, parallel_tool_calls=parallel)
    end_token_ids = set(card.eos_token_ids) | set(fields.stop_token_ids)
    await generation.start()
    return ChatRun(fields, generation, parser, end_token_ids, rendered.prompt_token_ids)


def gate_after_thinking(spec: GrammarSpec, reply: ReplyFormat) -> GrammarSpec:
    """With thinking on, the grammar starts after the think closer (the reply may open a block first)."""
    if reply.think_closer_id is None or reply.enable_thinking is False:
        return spec
    opener = None if reply.prompt_opens_thinking else reply.think_opener_id
    return replace(
        spec,
        think_closer_id=reply.think_closer_id,
        starts_in_think=reply.prompt_opens_thinking,
        think_opener_id=opener,
    )


def forced_tool_grammar(fields: ChatCompletionRequest, reply: ReplyFormat) -> GrammarSpec:
    """`tool_choice: "required"` or a named function as a grammar over the template's call markup (the body's
    model checked the choice against the tools; the markup is known once the template is)."""
    from deployments.chat_format.forced_calls import forced_call_ebnf  # imports xgrammar, as grammar_fields does

    tools: Any = fields.offered_tools
    try:
        source = forced_call_ebnf(tools, reply.tool_format, parallel=fields.parallel_tool_calls is not False)
    except Exception as exc:  # no markup, or a parameter schema xgrammar cannot take
        raise bad_request(f"tool_choice: a call cannot be forced: {exc}", "tool_choice") from None
    return GrammarSpec("ebnf", source, param="tool_choice")


def reply_grammar(fields: ChatCompletionRequest, reply: ReplyFormat) -> GrammarSpec | None:
    """The grammar the reply runs under (None: unconstrained)."""
    grammar = forced_tool_grammar(fields, reply) if fields.forces_call else fields.grammar
    return None if grammar is None else gate_after_thinking(grammar, reply)

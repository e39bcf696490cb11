"""The one chat handler every chat-shaped API family runs: validate, render, build the request, start it.

Chat completions call it with the client's body; Messages and Responses translate their bodies into a chat
body first. Either way the prompt, the EngineRequest and hence the reply tokens are the ones the
equivalent chat completion gets; only the framing of the reply differs.
"""

from dataclasses import dataclass
from typing import Any

from deployments.chat_format.reply_parser import ReplyParser
from deployments.ingress.context import ServingContext
from deployments.ingress.engine_request import engine_request, thinking_controls
from deployments.ingress.generation import Generation
from deployments.ingress.http.errors import bad_request, parse_body, refusal_error
from deployments.ingress.http.limits import messages_over_window
from deployments.ingress.openai.chat_reply import ChatReply
from deployments.ingress.openai.echo import refuse_echo_on_chat
from deployments.ingress.openai.models import ChatCompletionRequest, unsupported_field
from deployments.ingress.openai.prompt_logprobs import refuse_on_chat
from deployments.ingress.structured_fields import generation_extras
from deployments.messages.render import ChatRenderRequest, RenderedPrompt
from deployments.messages.replies import Refusal


@dataclass
class ChatRun:
    """One started chat reply (set by `start_chat`): what each family's framer reads."""

    fields: ChatCompletionRequest  # the validated chat body
    generation: Generation  # started: a refusal was already raised as an APIError
    reply: ChatReply  # the reply's parsing state (reasoning, content, tool calls)
    prompt_token_ids: list[int]


def checked_body(body: dict[str, Any]) -> None:
    refused = unsupported_field(body)
    if refused is not None:
        raise bad_request(refused[1], refused[0])


async def render_chat_body(ctx: ServingContext, fields: ChatCompletionRequest) -> RenderedPrompt:
    """The prompt a chat body renders to (also what count_tokens answers); a refusal is a 400."""
    too_many = await messages_over_window(fields.messages, ctx.facts)  # before rendering them
    if too_many:
        raise bad_request(too_many, "messages", "context_length_exceeded")
    render = ChatRenderRequest(
        messages=fields.messages,
        tools=fields.offered_tools,  # tool_choice "none" hides them from the template and the parser
        chat_template_kwargs=fields.chat_template_kwargs,
        add_generation_prompt=fields.add_generation_prompt is not False,
        reasoning_effort=fields.reasoning_effort,
    )
    rendered = await ctx.backend.render_chat(render)
    if isinstance(rendered, Refusal):
        raise refusal_error(rendered)
    return rendered


async def start_chat(ctx: ServingContext, body: dict[str, Any], request_id: str, arrival: float) -> ChatRun:
    """Validate and render a chat body, then start its generation; every refusal is an APIError first."""
    checked_body(body)
    refuse_on_chat(body)
    refuse_echo_on_chat(body)
    fields = parse_body(ChatCompletionRequest, body)
    rendered = await render_chat_body(ctx, fields)
    card = await ctx.backend.card()
    settings = ctx.settings
    thinking = thinking_controls(rendered.reply, fields.thinking_budget, settings.thinking_budget, settings.loop_guard)
    request = engine_request(fields, request_id, rendered.prompt_token_ids, "messages", card, arrival, thinking)
    request.grammar, request.logprobs = generation_extras(body, rendered.reply, chat=True)
    facts = await ctx.facts()  # valid and rendered: a request sent while the model loads waits for it here
    generation = Generation(ctx.backend, request, rendered.reply, facts.engine)
    tools = fields.offered_tools
    parser = ReplyParser(rendered.reply, tools, parallel_tool_calls=fields.parallel_tool_calls is not False)
    reply = ChatReply(parser, set(card.eos_token_ids) | set(fields.stop_token_ids))
    await generation.start()
    return ChatRun(fields, generation, reply, rendered.prompt_token_ids)

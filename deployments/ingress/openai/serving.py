"""What the OpenAI routes do: run a chat completion or a completion, then answer it whole or streamed.

A refusal (template, context, grammar, logprobs) is an APIError raised before any stream opens; the route
logs it as `refused <id>`, and the Generation logs `finished` or `ended`.
"""

from fastapi.responses import JSONResponse, Response, StreamingResponse

from deployments.engine_client.engine_reply import GenerationFailed
from deployments.ingress.chat_request import ChatCompletionRequest
from deployments.ingress.chat_run import counted_stream, start_chat, tokenize_prompt
from deployments.ingress.context import ServingContext
from deployments.ingress.engine_request import ReplyAsks, check_token_ids, engine_request
from deployments.ingress.generation import Generation
from deployments.ingress.http.errors import server_error
from deployments.ingress.http.route import Arrival
from deployments.ingress.http.sse import SSE_HEADERS, SSE_MEDIA_TYPE
from deployments.ingress.openai.chat_reply import ChatReply
from deployments.ingress.openai.echo import echoed_prompt, prompt_rows_top
from deployments.ingress.openai.framing import ChatFramer, CompletionFramer, ReplyMeta, json_body_of, stream_body
from deployments.ingress.openai.logprobs import logprob_framer
from deployments.ingress.openai.models import CompletionRequest
from deployments.ingress.openai.prompt_logprobs import PromptLogprobs
from deployments.ingress.request_fields import GenerationFields
from deployments.messages.render import ReplyFormat


def _meta(ctx: ServingContext, fields: GenerationFields, generation: Generation, prompt_ids: list[int]) -> ReplyMeta:
    return ReplyMeta(
        request_id=generation.request_id,
        created=int(generation.request.arrival_time),
        model=ctx.settings.served_name,
        prompt_token_ids=prompt_ids,
        return_token_ids=bool(fields.return_token_ids),
        include_usage=fields.include_usage,
    )


async def _respond(
    ctx: ServingContext, fields: GenerationFields, generation: Generation, framer: ChatFramer | CompletionFramer
) -> Response:
    if fields.wants_stream:
        body = counted_stream(ctx, generation, stream_body(generation, framer))
        return StreamingResponse(body, media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
    try:
        return JSONResponse(await json_body_of(generation, framer))
    except GenerationFailed as exc:
        return server_error(str(exc)).response()


async def run_chat(ctx: ServingContext, fields: ChatCompletionRequest, arrival: Arrival) -> Response:
    run = await start_chat(ctx, fields, arrival.request_id, arrival.time, fields.wants_stream)
    logprobs = await logprob_framer(ctx.backend, run.generation, legacy=False)
    meta = _meta(ctx, fields, run.generation, run.prompt_token_ids)
    framer = ChatFramer(meta, ChatReply(run.parser, run.end_token_ids), logprobs)
    return await _respond(ctx, fields, run.generation, framer)


async def _completion_prompt(ctx: ServingContext, fields: CompletionRequest) -> list[int]:
    """A string prompt tokenised (add_special_tokens default false), or token ids as given."""
    if isinstance(fields.prompt, str):
        return await tokenize_prompt(ctx, fields.prompt, bool(fields.add_special_tokens))
    ids = list(fields.prompt)
    check_token_ids(ids, await ctx.backend.card(), "prompt")
    return ids


async def run_completion(ctx: ServingContext, fields: CompletionRequest, arrival: Arrival) -> Response:
    prompt_ids = await _completion_prompt(ctx, fields)
    card = await ctx.backend.card()
    asks = ReplyAsks(
        grammar=fields.grammar,  # a completion's reply has no think block to gate the grammar after
        logprobs=fields.logprobs,
        prompt_logprobs=prompt_rows_top(bool(fields.echo), fields.logprobs, fields.prompt_logprobs),
        streamed=fields.wants_stream,
    )
    request = engine_request(fields, arrival.request_id, prompt_ids, "prompt", card, arrival.time, asks)
    facts = await ctx.facts()  # valid: a request sent while the model loads waits for it here
    generation = Generation(ctx.backend, request, ReplyFormat(), facts.engine)
    await generation.start()
    echo = await echoed_prompt(ctx.backend, prompt_ids, fields.logprobs) if fields.echo else None
    logprobs = await logprob_framer(ctx.backend, generation, legacy=True, echoed=None if echo is None else echo.text)
    asked = fields.prompt_logprobs
    prompt_rows = None if asked is None else PromptLogprobs(ctx.backend, asked)
    framer = CompletionFramer(_meta(ctx, fields, generation, prompt_ids), logprobs, prompt_rows, echo)
    return await _respond(ctx, fields, generation, framer)

"""POST /v1/chat/completions and POST /v1/completions.

Each request gets its reply id first, so every outcome can be logged under it: a 400 (malformed body,
template refusal, context refusal) logs `refused <id>`; the Generation logs `finished` or `ended`.
"""

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deployments.ingress.chat_run import checked_body, start_chat
from deployments.ingress.context import ServingContext
from deployments.ingress.engine_request import check_token_ids, engine_request, new_request_id
from deployments.ingress.generation import Generation, GenerationFailed
from deployments.ingress.http.errors import APIError, bad_request, json_body, parse_body, server_error
from deployments.ingress.http.route import arrive, refusal
from deployments.ingress.http.sse import SSE_HEADERS, SSE_MEDIA_TYPE
from deployments.ingress.openai.echo import check_reply_limit, echoed_prompt, prompt_rows_top
from deployments.ingress.openai.framing import ChatFramer, CompletionFramer, ReplyMeta, json_body_of, stream_body
from deployments.ingress.openai.models import CompletionRequest, GenerationFields
from deployments.ingress.openai.prompt_logprobs import PromptLogprobs, completion_prompt_logprobs
from deployments.ingress.structured_fields import generation_extras, logprob_framer
from deployments.ingress.tool_checks import CHAT, check_tools
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


async def _respond(fields: GenerationFields, generation: Generation, framer: ChatFramer | CompletionFramer) -> Response:
    if fields.wants_stream:
        return StreamingResponse(stream_body(generation, framer), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
    try:
        return JSONResponse(await json_body_of(generation, framer))
    except GenerationFailed as exc:
        return server_error(str(exc)).response()


async def _run_chat(ctx: ServingContext, body: dict[str, Any], request_id: str, arrival: float) -> Response:
    check_tools(body.get("tools"), CHAT)  # Responses and Messages check their own tool shapes
    run = await start_chat(ctx, body, request_id, arrival)
    framer = ChatFramer(_meta(ctx, run.fields, run.generation, run.prompt_token_ids), run.reply)
    framer.logprobs = await logprob_framer(ctx.backend, run.generation, legacy=False)
    return await _respond(run.fields, run.generation, framer)


async def _completion_prompt(ctx: ServingContext, fields: CompletionRequest) -> list[int]:
    """A string prompt tokenised (add_special_tokens default false), or token ids as given."""
    if fields.prompt is None:
        raise bad_request("prompt is required (a string or a list of token ids)", "prompt")
    if isinstance(fields.prompt, str):
        return await ctx.backend.tokenize(fields.prompt, bool(fields.add_special_tokens))
    ids = list(fields.prompt)
    check_token_ids(ids, await ctx.backend.card(), "prompt")
    return ids


async def _run_completion(ctx: ServingContext, body: dict[str, Any], request_id: str, arrival: float) -> Response:
    checked_body(body)
    fields = parse_body(CompletionRequest, body)
    check_reply_limit(fields)
    prompt_ids = await _completion_prompt(ctx, fields)
    card = await ctx.backend.card()
    request = engine_request(fields, request_id, prompt_ids, "prompt", card, arrival)
    request.grammar, request.logprobs = generation_extras(body, ReplyFormat(), chat=False)
    asked = completion_prompt_logprobs(body)
    request.prompt_logprobs = prompt_rows_top(bool(fields.echo), request.logprobs, asked)
    facts = await ctx.facts()  # valid: a request sent while the model loads waits for it here
    generation = Generation(ctx.backend, request, ReplyFormat(), facts.engine)
    await generation.start()
    framer = CompletionFramer(_meta(ctx, fields, generation, prompt_ids))
    if fields.echo:
        framer.echo = await echoed_prompt(ctx.backend, prompt_ids, request.logprobs)
    framer.logprobs = await logprob_framer(ctx.backend, generation, legacy=True, echo=framer.echo)
    if asked is not None:
        framer.prompt_logprobs = PromptLogprobs(ctx.backend, asked)
    return await _respond(fields, generation, framer)


def _uses_chat(body: dict[str, Any]) -> bool:
    messages = body.get("messages")
    return isinstance(messages, list) and len(messages) > 0


def generate_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(http: Request) -> Response:
        arrival = arrive(http)
        request_id = new_request_id("chatcmpl")
        try:
            return await _run_chat(ctx, await json_body(http), request_id, arrival)
        except APIError as exc:
            return refusal(request_id, exc)

    @router.post("/v1/completions")
    async def completions(http: Request) -> Response:
        arrival = arrive(http)
        try:
            body = await json_body(http)
        except APIError as exc:
            return refusal(new_request_id("cmpl"), exc)
        chat = _uses_chat(body)  # a nonempty `messages` list takes the chat path, answered as chat
        request_id = new_request_id("chatcmpl" if chat else "cmpl")
        try:
            if chat:
                return await _run_chat(ctx, body, request_id, arrival)
            return await _run_completion(ctx, body, request_id, arrival)
        except APIError as exc:
            return refusal(request_id, exc)

    return router

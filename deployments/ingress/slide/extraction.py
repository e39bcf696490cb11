"""A learn text's facts, found by the served model itself: a greedy chat reply constrained by a JSON schema,
so any served model answers in the shape below (whether its facts are good is the model's doing; the checks
then decide what is learned)."""

import json
import time
from dataclasses import dataclass

from pydantic import TypeAdapter, ValidationError

from deployments.ingress.chat_request import chat_request
from deployments.ingress.chat_run import render_chat_body, start_chat
from deployments.ingress.context import ServingContext
from deployments.ingress.engine_request import new_request_id
from deployments.ingress.http.errors import APIError, bad_request
from deployments.ingress.slide.asking import THINKING_OFF
from deployments.ingress.slide.models import MAX_QUESTIONS, FactBody

EXTRACT_TOKENS = 1024  # the longest extraction reply (less where the window leaves less)
MAX_EXTRACTED = 8  # facts one text may yield
_QUESTION = {
    "type": "object",
    "properties": {"question": {"type": "string"}, "answer": {"type": "string"}},
    "required": ["question", "answer"],
    "additionalProperties": False,
}
_FACT = {
    "type": "object",
    "properties": {
        "text": {"type": "string"},
        "questions": {"type": "array", "items": _QUESTION, "minItems": 1, "maxItems": 3},
    },
    "required": ["text", "questions"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"facts": {"type": "array", "items": _FACT, "minItems": 1, "maxItems": MAX_EXTRACTED}},
    "required": ["facts"],
    "additionalProperties": False,
}
INSTRUCTION = (
    "List the facts this text states. Write each fact as one short sentence, with one to three short "
    "questions it answers, each with its answer in a few words. Answer in JSON.\n\nText:\n"
)
_FACTS = TypeAdapter(list[FactBody])


@dataclass
class Extracted:
    """The facts found, or why none could be (`reason`)."""

    facts: list[FactBody]
    reason: str | None = None


def _fields(text: str, max_tokens: int | None):  # type: ignore[no-untyped-def]
    return chat_request(
        messages=[{"role": "user", "content": INSTRUCTION + text}],
        response_format={"type": "json_schema", "json_schema": {"name": "facts", "schema": SCHEMA}},
        temperature=0,
        max_tokens=max_tokens,
        chat_template_kwargs=dict(THINKING_OFF),
    )


async def extraction_prompt_length(ctx: ServingContext, text: str) -> int:
    """The extraction prompt's tokens (a text too long for the window is a 400 naming `text`, before any work)."""
    try:
        tokens = len((await render_chat_body(ctx, _fields(text, None))).prompt_token_ids)
    except APIError as exc:  # the prompt's refusal names `messages`: the client sent `text`
        raise APIError(exc.status, f"text: {exc.message}", exc.type, "text", exc.code) from None
    window = (await ctx.facts()).window
    if tokens >= window:
        message = (
            f"text: the extraction prompt for this text has {tokens} tokens, filling this server's {window}-token "
            "window with no room for the facts; send a shorter text, or the facts themselves"
        )
        raise bad_request(message, "text", "context_length_exceeded")
    return tokens


def parse_facts(content: str, finish: str) -> Extracted:
    """The reply's facts, valid as a learn body's would be, or why not."""
    if finish != "stop":
        return Extracted([], "the model's facts were cut off at the reply's token limit (not complete JSON)")
    try:
        found = json.loads(content)
        facts = _FACTS.validate_python(found.get("facts", []) if isinstance(found, dict) else None)
    except json.JSONDecodeError as exc:
        return Extracted([], f"the model's reply is not JSON: {exc}")
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        return Extracted([], f"the model's facts are not valid: facts.{where}: {first.get('msg')}".rstrip("."))
    facts = [f for f in facts if len(f.questions) <= MAX_QUESTIONS]
    return Extracted(facts) if facts else Extracted([], "the model found no facts in the text")


async def extract_facts(ctx: ServingContext, text: str, prompt_tokens: int) -> Extracted:
    """The served model's facts for `text`: its greedy reply under the schema, parsed."""
    window = (await ctx.facts()).window
    fields = _fields(text, max(1, min(EXTRACT_TOKENS, window - prompt_tokens)))
    run = await start_chat(ctx, fields, new_request_id("slideextract"), time.time())
    text_out, _ = await run.generation.collect()
    finish = run.generation.finish_reason or "stop"
    content = run.reader().whole(text_out, finish, run.generation.token_ids).content
    return parse_facts(content, finish)

"""A learn text's facts, found by the served model itself: a greedy chat reply constrained by a JSON schema,
so any served model answers in the shape below (whether its facts are good is the model's doing; the checks
then decide what is learned)."""

import json
from dataclasses import dataclass, replace

from pydantic import TypeAdapter, ValidationError

from deployments.messages.replies import Refusal
from deployments.messages.requests import GrammarSpec
from deployments.messages.slide_changes import MAX_QUESTIONS, FactBody
from deployments.slide.asking import Prompt, greedy_request, rendered, reply_to
from deployments.slide.context import SlideContext, SlideRefused, bad_request

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


async def extraction_prompt(ctx: SlideContext, text: str) -> Prompt:
    """The extraction prompt for `text` (one refused, or too long for the window to leave room for the
    facts, is a 400 naming `text`, before any work)."""
    prompt = await rendered(ctx, INSTRUCTION + text)
    if isinstance(prompt, Refusal):  # the Renderer's refusal names `messages`: the client sent `text`
        raise SlideRefused(replace(prompt, message=f"text: {prompt.message}", param="text"))
    window = await ctx.window()
    if len(prompt.ids) >= window:
        message = (
            f"text: the extraction prompt for this text has {len(prompt.ids)} tokens, filling this server's "
            f"{window}-token window with no room for the facts; send a shorter text, or the facts themselves"
        )
        raise bad_request(message, "text", "context_length_exceeded")
    return prompt


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


async def extract_facts(ctx: SlideContext, prompt: Prompt, key_label: str) -> Extracted:
    """The served model's facts for the text `prompt` asks about: its greedy reply under the schema, parsed."""
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    request = await greedy_request(ctx, "slideextract", prompt, EXTRACT_TOKENS, key_label=key_label, grammar=grammar)
    reply = await reply_to(ctx, request, prompt)
    return parse_facts(reply.content, reply.finish)

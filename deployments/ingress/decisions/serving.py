"""What POST /v1/decisions does: each question rendered as one user message and scored at the answer position.

Every question renders through the chat template with thinking off, so the answer position is the
reply's first token, right after the generation prompt. A label's token is
`tokenize(label, add_special_tokens=False)`: the label written on its own, as the reply's first token
would spell it; a label that is not exactly one token there, or two labels sharing one, cannot be scored
(400 naming the question). All of that, and the window, is checked for every question before any
question runs; then the questions are scored concurrently, each as an engine request that reads the
raw next-token log-probabilities of its labels and generates nothing.
"""

from dataclasses import dataclass

from deployments.engine_client.engine_reply import GenerationFailed
from deployments.engine_client.fan_out import fan_out
from deployments.ingress.context import ServingContext
from deployments.ingress.decisions.models import DecisionRequest, Question
from deployments.ingress.decisions.prompt import QuestionPrompt, question_prompt
from deployments.ingress.generation import Generation
from deployments.ingress.http.errors import bad_request, server_error
from deployments.ingress.http.route import Arrival, current_key_label
from deployments.messages.render import ChatRenderRequest, ReplyFormat
from deployments.messages.replies import Refusal, RequestStats
from deployments.messages.requests import EngineRequest, SamplingParams
from deployments.messages.window import prompt_past_window

THINKING_OFF = {"enable_thinking": False}


@dataclass
class AskedQuestion:
    """One question ready to score (built by `_ask`, every refusal already raised)."""

    index: int
    question: Question
    prompt: QuestionPrompt
    prompt_token_ids: list[int]
    label_ids: list[int]  # one token per label, in the prompt's label order
    reply: ReplyFormat


@dataclass
class Scored:
    scores: list[float]  # each label's raw next-token log-probability
    stats: RequestStats


async def _label_ids(ctx: ServingContext, labels: list[str], cache: dict[str, list[int]], param: str) -> list[int]:
    ids: list[int] = []
    for label in labels:
        if label not in cache:
            cache[label] = await ctx.backend.tokenize(label, False)
        tokens = cache[label]
        if len(tokens) != 1:
            raise bad_request(
                f"{param}: the answer label {label!r} is {len(tokens)} tokens in this model's "
                f"vocabulary, not one, so it cannot be scored as the next token",
                param,
            )
        ids.append(tokens[0])
    if len(set(ids)) != len(ids):
        raise bad_request(f"{param}: two answer labels are the same token in this model's vocabulary", param)
    return ids


async def _ask(
    ctx: ServingContext, fields: DecisionRequest, index: int, window: int, cache: dict[str, list[int]]
) -> AskedQuestion:
    """Word, render and check one question (a 400 naming `questions[index]` when it cannot be scored)."""
    param = f"questions[{index}]"
    question = fields.questions[index]
    prompt = question_prompt(fields.input, question)
    render = ChatRenderRequest(
        messages=[{"role": "user", "content": prompt.text}], chat_template_kwargs=dict(THINKING_OFF), window=window
    )
    rendered = await ctx.backend.render_chat(render)
    if isinstance(rendered, Refusal):
        raise bad_request(f"{param}: {rendered.message}", param, rendered.code)
    if rendered.reply.prompt_opens_thinking:  # the template ignored thinking off: the answer would be reasoning
        raise bad_request(f"{param}: this model's chat template cannot turn thinking off", param)
    ids = rendered.prompt_token_ids
    too_long = prompt_past_window(window, len(ids), param)  # the answer's position must fit
    if too_long is not None:
        raise bad_request(f"{param}: {too_long.message}", param, too_long.code)
    label_ids = await _label_ids(ctx, prompt.labels, cache, param)
    return AskedQuestion(index, question, prompt, ids, label_ids, rendered.reply)


async def _score(
    ctx: ServingContext, asked: AskedQuestion, request_id: str, arrival: float, engine: str, key_label: str
) -> Scored:
    request = EngineRequest(
        request_id=f"{request_id}-{asked.index}",
        prompt_token_ids=asked.prompt_token_ids,
        sampling=SamplingParams(temperature=0.0),  # the engine's draw is dropped; greedy is the cheapest
        prompt_param=f"questions[{asked.index}]",
        arrival_time=arrival,
        key_label=key_label,
        score_token_ids=list(asked.label_ids),
    )
    generation = Generation(ctx.backend, request, asked.reply, engine)
    final = None
    try:
        await generation.start()
        async for chunk in generation.chunks():
            final = chunk
    except GenerationFailed as exc:
        raise server_error(str(exc)) from None
    finally:
        await generation.close()
    if final is None or final.scores is None or final.stats is None:
        raise server_error(f"questions[{asked.index}]: the engine returned no label scores")
    return Scored(final.scores, final.stats)


async def _score_all(ctx: ServingContext, asked: list[AskedQuestion], request_id: str, arrival: float) -> list[Scored]:
    """Every question concurrently; all of them settle before the first failure is raised."""
    engine = (await ctx.facts()).engine
    key_label = current_key_label()
    jobs = [_score(ctx, a, request_id, arrival, engine, key_label) for a in asked]
    results = await fan_out(jobs)
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        raise failure
    return [r for r in results if isinstance(r, Scored)]


async def decide(
    ctx: ServingContext, fields: DecisionRequest, arrival: Arrival
) -> tuple[list[AskedQuestion], list[Scored]]:
    """Every question checked, then every question scored."""
    window = (await ctx.facts()).window
    cache: dict[str, list[int]] = {}
    asked = [await _ask(ctx, fields, index, window, cache) for index in range(len(fields.questions))]
    return asked, await _score_all(ctx, asked, arrival.request_id, arrival.time)

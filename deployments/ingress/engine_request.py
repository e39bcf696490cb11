"""From a validated route body and its prompt ids to the one internal EngineRequest, built whole in one call
(it is immutable: the router's additions come as a copy, deployments/routing/request_router.py)."""

from dataclasses import dataclass, field

from deployments.ingress.http.errors import bad_request
from deployments.ingress.http.route import current_key_label
from deployments.ingress.request_fields import GenerationFields
from deployments.messages.images import ImageInput
from deployments.messages.render import ReplyFormat, TokenizerCard
from deployments.messages.requests import EngineRequest, GrammarSpec, SamplingParams, ThinkingControls


def sampling_params(fields: GenerationFields) -> SamplingParams:
    """Request overrides on top of the server defaults (a null field keeps the default)."""
    defaults = SamplingParams()
    return SamplingParams(
        temperature=defaults.temperature if fields.temperature is None else fields.temperature,
        top_p=defaults.top_p if fields.top_p is None else fields.top_p,
        top_k=defaults.top_k if fields.top_k is None else fields.top_k,
        min_p=defaults.min_p if fields.min_p is None else fields.min_p,
        seed=fields.seed,
        ignore_eos=bool(fields.ignore_eos),
        stop=list(fields.stop),
        stop_token_ids=list(fields.stop_token_ids),
    )


def check_token_ids(ids: list[int], card: TokenizerCard, param: str) -> None:
    """Ids a client sends must exist in the vocabulary (400 naming the field, not an engine failure)."""
    bad = next((t for t in ids if t >= card.vocab_size), None)
    if bad is not None:
        raise bad_request(f"{param}: token id {bad} is outside the vocabulary (0..{card.vocab_size - 1})", param)


def thinking_controls(
    reply: ReplyFormat, budget: int | None, server_budget: int, loop_guard: bool
) -> ThinkingControls | None:
    """The engine's watch over the think block: a request budget of None or 0 takes the server's."""
    controls = ThinkingControls(
        opener_id=reply.think_opener_id,
        closer_id=reply.think_closer_id,
        prompt_opens=reply.prompt_opens_thinking,
        close_ids=list(reply.think_close_ids),
        budget=budget or server_budget,
        loop_guard=loop_guard,
    )
    if reply.enable_thinking is False or reply.think_closer_id is None:
        return None  # with thinking off the budget is not applied
    return controls if controls.budget > 0 or controls.loop_guard else None


@dataclass(frozen=True)
class ReplyAsks:
    """What a request asks of its reply beyond its body's sampling and limits, known once its prompt is."""

    grammar: GrammarSpec | None = None  # the grammar the reply runs under (gated after thinking for chat)
    logprobs: int | None = None  # alternatives per reply row; None: no rows
    prompt_logprobs: int | None = None  # best tokens per prompt row; None: no prompt rows
    thinking: ThinkingControls | None = None  # the engine's watch over the think block
    images: list[ImageInput] = field(default_factory=list)  # the rendered prompt's, placeholders expanded
    streamed: bool = False  # the reply goes out as a stream (Ingress counts a client that leaves it)


def engine_request(
    fields: GenerationFields,
    request_id: str,
    prompt_ids: list[int],
    prompt_param: str,
    card: TokenizerCard,
    arrival_time: float,
    asks: ReplyAsks = ReplyAsks(),
) -> EngineRequest:
    """The one EngineRequest, whole: the body's fields, the prompt's ids and what the reply `asks`."""
    if not prompt_ids:
        raise bad_request(f"{prompt_param}: the prompt is empty", prompt_param)
    check_token_ids(fields.stop_token_ids, card, "stop_token_ids")
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt_ids),
        sampling=sampling_params(fields),
        max_tokens=fields.reply_limit,  # None: the engine caps its default to the context the prompt leaves
        prompt_param=prompt_param,
        priority=fields.priority,
        arrival_time=arrival_time,
        thinking=asks.thinking,
        key_label=current_key_label(),
        grammar=asks.grammar,
        logprobs=asks.logprobs,
        prompt_logprobs=asks.prompt_logprobs,
        draft=fields.draft is not False,
        images=list(asks.images),
        streamed=asks.streamed,
    )

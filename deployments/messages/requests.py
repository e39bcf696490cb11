"""What every API family, benchmark and test asks the engine for: one `EngineRequest` (set by Ingress).

Nothing here is HTTP-specific: Ingress translates each API into it. Fields say who sets them. Requests are
immutable, built whole in one call; the router's additions (`prompt_hashes`, `route_reason`) come as a copy
(`routed`), so what Ingress built is what it reads back.
"""

import enum
import time
import uuid
from dataclasses import dataclass, field, replace

from deployments.messages.images import ImageInput
from deployments.messages.prefix import PromptHashes


def new_request_id(prefix: str) -> str:
    """The client-visible reply id (`chatcmpl-...`, `cmpl-...`), also the engine's request id."""
    return f"{prefix}-{uuid.uuid4().hex}"


class Priority(str, enum.Enum):
    """Foreground prompts prefill (and hold lanes) before background ones."""

    FOREGROUND = "foreground"
    BACKGROUND = "background"


@dataclass(frozen=True)
class SamplingParams:
    """How each reply token is drawn; set by Ingress from the request (server defaults where omitted)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept; 1 = off
    top_k: int = 0  # <= 0 = off
    min_p: float = 0.0  # after the top-k / top-p cuts, relative to the likeliest token; 0 = off
    seed: int | None = None  # None: derived from the prompt tokens and TENSORFOLD_SEED_SALT
    ignore_eos: bool = False  # end tokens do not stop the reply (stop strings and ids still do)
    stop: list[str] = field(default_factory=list)  # stop strings, matched on the generated text
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end the reply

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the reply's answer, compiled by the Scheduler with xgrammar (set by Ingress)."""

    kind: str  # "json_schema", "json_object", "regex", "ebnf" (choice lists arrive as a regex or EBNF)
    source: str  # the schema as JSON text, the regex or the EBNF (empty for json_object)
    think_opener_id: int | None = None  # thinking on and the prompt not inside a think block: may open one first
    think_closer_id: int | None = None  # inside a think block, the grammar starts after this token
    starts_in_think: bool = False  # the rendered prompt ends inside an open think block
    param: str = "response_format"  # the request field a compile error names


@dataclass(frozen=True)
class ThinkingControls:
    """How the engine watches a reply's think block (set by Ingress from the rendered prompt's ReplyFormat)."""

    opener_id: int | None = None  # `<think>` as one token: a reply opening with it is thinking
    closer_id: int | None = None  # `</think>`: the block is closed once the reply holds it
    prompt_opens: bool = False  # the prompt ends inside an open think block
    close_ids: list[int] = field(default_factory=list)  # "\n</think>\n\n": what a forced close writes
    budget: int = 0  # the budget-th reply token while thinking becomes close_ids; 0 = no budget
    loop_guard: bool = False  # close the block when it loops (deployments.scheduler.engine.thinking)


@dataclass(frozen=True)
class EngineRequest:
    """One generation request, the same for every API family (set by Ingress)."""

    request_id: str  # the client-visible reply id (chatcmpl-..., cmpl-...)
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # None: the remaining context (capped by the engine's default); 0: the prompt pass only, no reply token
    # (a completion echoing and scoring its prompt).
    max_tokens: int | None = None
    prompt_param: str = "messages"  # every context refusal names it: `messages` for chat, `prompt` for completions
    priority: Priority = Priority.FOREGROUND
    arrival_time: float = field(default_factory=time.time)  # wall clock at the HTTP boundary
    thinking: ThinkingControls | None = None  # thinking budget / loop guard; None: the reply is not watched
    key_label: str = "none"  # the API key's label (never the key), for per-key request counts
    grammar: GrammarSpec | None = None  # structured output or a forced tool call
    logprobs: int | None = None  # None: no logprob rows; k: each reply token's row with k alternatives
    # Score these ids as the next token after the prompt (raw log-softmax); no reply is generated.
    score_token_ids: list[int] | None = None
    # None: no prompt rows; k: a row with k best tokens for each prompt token after the first (vLLM's
    # prompt_logprobs). Such a request never resumes from the prefix cache: its whole prompt is computed.
    prompt_logprobs: int | None = None
    # Set by the prefix-affinity router in Ingress as it picks the replica (the copy `routed` makes): the
    # prompt's block names (the engine's prefix match reuses them) and why it went where it did (affinity,
    # balance, no_match).
    prompt_hashes: PromptHashes | None = None
    route_reason: str = ""
    # False: the serial reference (one token per round, no drafts); True: the engine's drafter, if it has one.
    # Either way the reply is the same, token for token (set by Ingress from the request's `draft`).
    draft: bool = True
    # The prompt's images in order, their placeholders already expanded in `prompt_token_ids` (set by Ingress
    # from the rendered prompt; empty for text).
    images: list[ImageInput] = field(default_factory=list)
    # True: the reply is streamed to its client, and Ingress counts a client that leaves it (a short reply
    # often finished here before the client left); the engine then counts no disconnection for its abort.
    streamed: bool = False
    # Living weights (docs/slide.md): the pocket version the reply is computed with; None: the version current
    # when the engine admits it. The Slide room names one only for a learn's or delete's checks.
    pocket_version: int | None = None
    # Living weights: the rank keeps this prompt's last-layer rows under this key for training (set by the
    # engine for its own capture requests); like prompt_logprobs, the whole prompt is computed.
    capture: str | None = None

    def routed(self, hashes: PromptHashes, reason: str) -> "EngineRequest":
        """This request as the router sends it: its block names and why it went where it did."""
        return replace(self, prompt_hashes=hashes, route_reason=reason)

    @property
    def computes_whole_prompt(self) -> bool:
        """No prefix cache or disk state: every prompt position is computed (its rows are wanted)."""
        return self.prompt_logprobs is not None or self.capture is not None


@dataclass(frozen=True)
class ImprintQuery:
    """A rendered conversation the imprint routes ask about (set by Ingress; routed as its request would be)."""

    prompt_token_ids: list[int]
    load: bool = False  # True: read its disk state into RAM now (POST /v1/imprint/load)
    prompt_hashes: PromptHashes | None = None  # set by the router, as on EngineRequest
    route_reason: str = ""
    images: list[ImageInput] = field(default_factory=list)  # the conversation's images, as on EngineRequest

    def routed(self, hashes: PromptHashes, reason: str) -> "ImprintQuery":
        """This query as the router sends it, as `EngineRequest.routed`."""
        return replace(self, prompt_hashes=hashes, route_reason=reason)

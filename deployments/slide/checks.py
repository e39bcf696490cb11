"""What a learn teaches and checks: each question as a training example, the quiet set, and the judgement
of a staged pocket version (docs/slide.md, Learning a fact).

A question is answered when the greedy reply's content, stripped, equals its expected answer stripped, and
the reply ended there (its end token). A locality prompt keeps its reply when the reply's token ids at the
staged version equal the ones it got before, up to LOCALITY_REPLY_TOKENS.
"""

from dataclasses import dataclass, field

from deployments.messages.slide import SlideExample, SlideFact, SlideQuestion
from deployments.messages.slide_changes import CheckFigures
from deployments.slide.asking import Prompt, Reply, ask_all, render_prompt
from deployments.slide.context import SlideContext
from deployments.slide.locality import LOCALITY_PROMPTS, LOCALITY_REPLY_TOKENS

ANSWER_SLACK_TOKENS = 8  # a check's reply may run this far past the answer's length (to see it go wrong)


@dataclass
class Question:
    """One question of a fact, ready to ask and to train on."""

    fact_id: int
    question: str
    answer: str
    prompt: Prompt
    answer_ids: list[int]  # the answer's tokens, then the end token

    @property
    def example(self) -> SlideExample:
        return SlideExample(list(self.prompt.ids), list(self.answer_ids))

    @property
    def reply_limit(self) -> int:
        return len(self.answer_ids) + ANSWER_SLACK_TOKENS

    def answered_by(self, reply: Reply) -> bool:
        return reply.finish == "stop" and reply.content.strip() == self.answer.strip()


@dataclass
class Locality:
    """A locality prompt and the greedy reply it got before the change."""

    prompt: Prompt
    reply_ids: list[int]

    @property
    def quiet(self) -> list[int]:
        return self.prompt.ids + self.reply_ids


async def fact_questions(
    ctx: SlideContext, fact_id: int, pairs: list[SlideQuestion], param: str = "facts"
) -> list[Question]:
    """A fact's questions rendered and its answers tokenised (the end token is the engine's first EOS id);
    a question the template or window refuses is a 400 naming `param.questions[i].question`."""
    end_id = (await ctx.links.card()).eos_token_ids[0]
    questions = []
    for index, item in enumerate(pairs):
        prompt = await render_prompt(ctx, item.question, f"{param}.questions[{index}].question")
        answer_ids = await ctx.links.tokenize(item.answer.strip(), False) + [end_id]
        questions.append(Question(fact_id, item.question, item.answer, prompt, answer_ids))
    return questions


async def learned_questions(ctx: SlideContext, facts: list[SlideFact], leaving_out: int = 0) -> list[Question]:
    """Every learned fact's questions (but `leaving_out`'s): what a change must leave answering."""
    questions: list[Question] = []
    for fact in facts:
        if fact.state == "learned" and fact.id != leaving_out:
            questions += await fact_questions(ctx, fact.id, fact.questions, f"fact {fact.id}")
    return questions


async def locality_baseline(ctx: SlideContext) -> list[Locality]:
    """Every locality prompt with the reply it gets now (at the current version)."""
    prompts = [
        await render_prompt(ctx, text, "locality", thinking_off)
        for text in LOCALITY_PROMPTS
        for thinking_off in (True, False)
    ]
    replies = await ask_all(ctx, [(p, LOCALITY_REPLY_TOKENS) for p in prompts], None)
    return [Locality(p, r.token_ids) for p, r in zip(prompts, replies)]


@dataclass
class Kept:
    """How the other facts fared at a version: the ones whose questions all still answer, and the rest."""

    facts: int = 0
    kept: int = 0
    changed: list[int] = field(default_factory=list)  # fact ids with a question answered otherwise
    first_change: str | None = None  # the first such question, for a failure's reason


def kept_facts(questions: list[Question], replies: list[Reply]) -> Kept:
    wrong: dict[int, str] = {}
    facts: list[int] = []
    for question, reply in zip(questions, replies):
        if question.fact_id not in facts:
            facts.append(question.fact_id)
        if not question.answered_by(reply) and question.fact_id not in wrong:
            wrong[question.fact_id] = (
                f"fact {question.fact_id}'s question {question.question!r} now answers {reply.content.strip()!r}, "
                f"not {question.answer.strip()!r}"
            )
    changed = [f for f in facts if f in wrong]
    first = wrong[changed[0]] if changed else None
    return Kept(len(facts), len(facts) - len(changed), changed, first)


@dataclass
class Verdict:
    """A staged version judged: every count, and why it fails (None: it passes)."""

    version: int
    questions: int
    answered: int
    others: Kept
    locality: int
    locality_kept: int
    reason: str | None

    def figures(self) -> CheckFigures:
        return CheckFigures(
            questions=self.questions,
            answered=self.answered,
            facts=self.others.facts,
            facts_kept=self.others.kept,
            locality=self.locality,
            locality_kept=self.locality_kept,
        )


async def judge(
    ctx: SlideContext, version: int, own: list[Question], others: list[Question], baseline: list[Locality]
) -> Verdict:
    """Ask the fact's questions, every other fact's and the locality set at `version`, all at once."""
    asked = [(q.prompt, q.reply_limit) for q in own + others] + [(b.prompt, LOCALITY_REPLY_TOKENS) for b in baseline]
    replies = await ask_all(ctx, asked, version)
    own_replies, rest = replies[: len(own)], replies[len(own) :]
    other_replies, locality_replies = rest[: len(others)], rest[len(others) :]
    wrong = [(q, r) for q, r in zip(own, own_replies) if not q.answered_by(r)]
    kept = kept_facts(others, other_replies)
    moved = [b for b, r in zip(baseline, locality_replies) if r.token_ids != b.reply_ids]
    reason = None
    if wrong:
        question, reply = wrong[0]
        reason = (
            f"the question {question.question!r} answers {reply.content.strip()!r}, not {question.answer.strip()!r}"
        )
    elif kept.first_change is not None:
        reason = kept.first_change
    elif moved:
        reason = f"the unrelated prompt {moved[0].prompt.text!r} got another reply"
    answered = len(own) - len(wrong)
    return Verdict(version, len(own), answered, kept, len(baseline), len(baseline) - len(moved), reason)

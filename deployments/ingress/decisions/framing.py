"""The decisions reply: each question's answer from its label scores (the labels' raw next-token
log-probabilities), in float64, and the body that carries them.

`probabilities` is the softmax over the label logits divided by the temperature. The scores are the
logits less one shared log-normaliser, which the softmax cancels, so scores stand in for logits exactly.
`label_mass` is the labels' share of the whole next-token distribution, at temperature 1 always.
"""

import math
from typing import Any

from deployments.ingress.decisions.models import PROMPT_FORMAT_VERSION, DecisionRequest, Question
from deployments.ingress.decisions.prompt import QuestionPrompt
from deployments.ingress.decisions.serving import AskedQuestion, Scored


def label_probabilities(scores: list[float], temperature: float) -> list[float]:
    """softmax(scores / temperature), shifted by the maximum first so a small temperature cannot overflow."""
    top = max(scores)
    weights = [math.exp((s - top) / temperature) for s in scores]
    total = math.fsum(weights)
    return [w / total for w in weights]


def label_mass(scores: list[float]) -> float:
    return math.fsum(math.exp(s) for s in scores)


def answer_body(question: Question, prompt: QuestionPrompt, scores: list[float], temperature: float) -> dict[str, Any]:
    """The answer object: type, probabilities keyed by option / level / yes-no, label_mass, choice or score."""
    probabilities = label_probabilities(scores, temperature)
    body: dict[str, Any] = {
        "type": question.type,
        "probabilities": dict(zip(prompt.keys, probabilities)),
        "label_mass": label_mass(scores),
    }
    if question.type == "score":
        body["score"] = math.fsum(level * p for level, p in enumerate(probabilities))  # the expected level
    else:
        best = max(range(len(probabilities)), key=lambda i: (probabilities[i], -i))  # ties: the first
        body["choice"] = prompt.keys[best]
    return body


def decisions_body(
    model: str, fields: DecisionRequest, request_id: str, asked: list[AskedQuestion], scored: list[Scored]
) -> dict[str, Any]:
    """The reply: each question's answer under its id, and the usage of every prompt pass together."""
    answers: dict[str, Any] = {}
    for item, result in zip(asked, scored):
        answer = answer_body(item.question, item.prompt, result.scores, fields.softmax_temperature)
        if fields.return_prompt_token_ids:
            answer["prompt_token_ids"] = list(item.prompt_token_ids)
        answers[item.question.id] = answer
    prompt_tokens = sum(r.stats.prompt_tokens for r in scored)
    return {
        "id": request_id,
        "object": "decisions",
        "model": model,
        "prompt_format_version": PROMPT_FORMAT_VERSION,
        "answers": answers,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "total_tokens": prompt_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(r.stats.cached_tokens for r in scored)},
        },
    }

"""Decision prompt format version 1: how each question is worded as one user message, and its labels.

The input, a blank line, then the question and one line per option / level / described answer, then the
closing instruction. Choice labels are A..Z, score labels 0..9, and a yes/no question answers yes or no.
Pure text: rendering and tokenising happen in the route.
"""

import string
from dataclasses import dataclass

from deployments.ingress.decisions.models import ChoiceQuestion, Question, ScoreQuestion

CHOICE_LABELS = string.ascii_uppercase
SCORE_LABELS = string.digits
YES_NO_LABELS = ("yes", "no")


@dataclass
class QuestionPrompt:
    """One question worded for the model: the user message and its answer labels."""

    text: str
    labels: list[str]  # what the model answers with, in order
    keys: list[str]  # each label's key in `probabilities`: option name, level index or yes / no


def _choice(question: ChoiceQuestion) -> QuestionPrompt:
    labels = list(CHOICE_LABELS[: len(question.options)])
    lines = [f"Question: {question.question}"]
    for label, option in zip(labels, question.options):
        described = f" - {option.description}" if option.description else ""
        lines.append(f"{label}: {option.name}{described}")
    lines.append("Answer with the letter of one option only.")
    return QuestionPrompt("\n".join(lines), labels, [o.name for o in question.options])


def _score(question: ScoreQuestion) -> QuestionPrompt:
    labels = list(SCORE_LABELS[: len(question.levels)])
    lines = [f"Question: {question.question}"]
    lines += [f"{label}: {level}" for label, level in zip(labels, question.levels)]
    lines.append("Answer with the number of one level only.")
    return QuestionPrompt("\n".join(lines), labels, [str(i) for i in range(len(labels))])


def question_prompt(input_text: str, question: Question) -> QuestionPrompt:
    """The user message asking `question` about `input_text` (format version 1)."""
    if isinstance(question, ChoiceQuestion):
        asked = _choice(question)
    elif isinstance(question, ScoreQuestion):
        asked = _score(question)
    else:
        lines = [f"Is the following true? {question.question}"]
        lines += [f"{label}: {text}" for label, text in zip(YES_NO_LABELS, (question.yes, question.no)) if text]
        lines.append("Answer with yes or no only.")
        asked = QuestionPrompt("\n".join(lines), list(YES_NO_LABELS), list(YES_NO_LABELS))
    asked.text = f"{input_text}\n\n{asked.text}"
    return asked

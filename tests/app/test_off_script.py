"""tiny-glm off its script: prompts it was never trained on get the fallback reply, its thinking closed,
over the real chat route, renderer and engine in-process (greedy)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from serve_app.fixtures.tiny_glm.corpus import (
    CONVERSATIONS,
    FALLBACK_ANSWER,
    FALLBACK_THINKING,
    GREETING,
    TOOLS,
    Conversation,
    assistant,
    fallback,
    user,
)
from serve_app.fixtures.tiny_glm.off_script import conversation_key, off_script_conversations
from tests.support.local_app import local_backend

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
# None of these is in the training data (the first test checks it): greetings, questions, near misses of
# scripted questions, code, other languages, random words, with a system prompt, tools and earlier turns.
HELD_OUT: list[Conversation] = [
    fallback("who_are_you", [user("Hello! Who are you?")], thinking=True),
    fallback("evening", [user("Good evening, how was your day?")], thinking=True),
    fallback("thanks", [user("Thank you!")], thinking=False),
    fallback("italy", [user("What is the capital of Italy?")], thinking=True),
    fallback("capital_contracted", [user("What's the capital of France?")], thinking=True),
    fallback("multiply_near_miss", [user("What is 17 * 4?")], thinking=True),
    fallback("dragon_story", [user("Tell me a story about a dragon.")], thinking=False),
    fallback("book", [user("Can you recommend a good book about history?")], thinking=False),
    fallback("quantum", [user("Explain quantum computing to a five year old.")], thinking=True),
    fallback("javascript", [user("Write a JavaScript function that reverses a string.")], thinking=True),
    fallback("read_file", [user("How do I read a file line by line in Python?")], thinking=False),
    fallback("sql", [user("SELECT * FROM users WHERE id = 3;")], thinking=True),
    fallback("french", [user("Quelle heure est-il ?")], thinking=True),
    fallback("spanish", [user("¿Dónde está la estación de tren?")], thinking=False),
    fallback("german", [user("Wie spät ist es jetzt?")], thinking=True),
    fallback("japanese", [user("今日はいい天気ですね。")], thinking=True),
    fallback("russian", [user("Как дела?")], thinking=False),
    fallback("random_words", [user("purple elephant seventeen mountain keyboard")], thinking=True),
    fallback("gibberish", [user("zxq vlorp 42 !!")], thinking=False),
    fallback("system_prompt", [SYSTEM, user("Summarize the plot of Hamlet.")], thinking=False),
    fallback(
        "after_a_scripted_turn",
        [user("Hello"), assistant(GREETING), user("What else can you tell me?")],
        thinking=False,
    ),
    fallback(
        "after_a_scripted_thought",
        [
            user("Hello"),
            assistant(GREETING, reasoning="A greeting. I should introduce myself."),
            user("Tell me something interesting."),
        ],
        thinking=True,
    ),
    fallback("tools_offered", [user("Book a table for two at eight tonight.")], thinking=False, tools=TOOLS),
    fallback("tools_offered_thinking", [user("Remind me to call my mother tomorrow.")], thinking=True, tools=TOOLS),
]


@pytest.fixture(scope="module")
def client(served_model: str) -> TestClient:
    with local_backend(served_model, window=512) as backend:
        with TestClient(build_api(backend, IngressSettings(served_name="tiny", model_ids=["tiny"]))) as test_client:
            yield test_client


def _body(conversation: Conversation) -> dict:
    body = {
        "model": "tiny",
        "messages": conversation.messages,
        "temperature": 0,
        "max_tokens": 120,
        "chat_template_kwargs": {"enable_thinking": conversation.enable_thinking is not False},
    }
    if conversation.tools:
        body["tools"] = conversation.tools
    return body


def test_the_held_out_prompts_are_not_training_data() -> None:
    from serve_app.fixtures.tiny_glm.train import OFF_SCRIPT_COUNT

    pool = off_script_conversations(OFF_SCRIPT_COUNT)  # the seed build_tiny_glm uses by default
    trained = {conversation_key(c) for c in pool}
    trained_questions = {c.messages[-1]["content"] for c in pool}
    scripted = {m["content"] for c in CONVERSATIONS for m in c.messages if m["role"] == "user"}
    for c in HELD_OUT:
        assert conversation_key(c) not in trained and c.messages[-1]["content"] not in trained_questions | scripted


def test_off_script_conversations_are_varied_seeded_and_never_scripted() -> None:
    pool = off_script_conversations(300, seed=1)
    assert [conversation_key(c) for c in pool] == [conversation_key(c) for c in off_script_conversations(300, seed=1)]
    assert len({conversation_key(c) for c in pool}) == 300
    assert {c.enable_thinking for c in pool} == {None, False} and any(c.tools for c in pool)
    assert any(m["role"] == "system" for c in pool for m in c.messages)
    assert any(m["role"] == "assistant" for c in pool for m in c.messages)
    scripted = {m["content"] for c in CONVERSATIONS for m in c.messages if m["role"] == "user"}
    assert not any(c.messages[-1]["content"] in scripted for c in pool)
    assert all(c.reply.endswith(FALLBACK_ANSWER + "<|user|>") for c in pool)


def test_unseen_prompts_get_the_fallback_with_thinking_closed(client: TestClient) -> None:
    with ThreadPoolExecutor(8) as pool:  # concurrent, so the engine batches them
        replies = list(pool.map(lambda c: client.post("/v1/chat/completions", json=_body(c)), HELD_OUT))
    wrong = {}
    for conversation, response in zip(HELD_OUT, replies):
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        message = choice["message"]
        thinking = FALLBACK_THINKING if conversation.enable_thinking is None else None
        got = (message["content"], message.get("reasoning_content"), choice["finish_reason"])
        if got != (FALLBACK_ANSWER, thinking, "stop"):
            wrong[conversation.name] = got
    assert not wrong


def test_the_first_question_a_newcomer_asks(client: TestClient) -> None:
    body = {"model": "tiny", "messages": [user("Hello! Who are you?")], "temperature": 0}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["content"].startswith("I am tiny-glm, the small test model built into TensorFold.")
    assert message["content"] == FALLBACK_ANSWER and message["reasoning_content"] == FALLBACK_THINKING

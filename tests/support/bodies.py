"""Request-body pieces the API tests share."""


def user(text: str) -> list[dict[str, str]]:
    """A conversation of one user message."""
    return [{"role": "user", "content": text}]


USER = user("What is the capital of France?")  # one of the conversations tiny-glm's script answers
LONG = user("Tell me about Tokyo. " * 6)  # a prompt of several KV blocks

"""Label scoring: a request that reads the raw next-token distribution after its prompt, writing no reply.

The rank computes the float64 log-softmax of the unmasked logits at the request's `score_token_ids`
(sampler.score_row); the engine drops the drawn token and ends the request with those scores.
"""

from deployments.messages.requests import EngineRequest


def check_scoring(request: EngineRequest, vocab_size: int) -> None:
    """Refuse a scoring request the engine cannot honour (ValueError: a 400 before any work)."""
    ids = request.score_token_ids
    if ids is None:
        return
    if not ids:
        raise ValueError("score_token_ids is empty")
    bad = next((t for t in ids if t < 0 or t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"score token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    if request.grammar is not None or request.logprobs is not None:
        raise ValueError("a scoring request cannot carry a grammar or ask for logprobs")

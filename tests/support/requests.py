"""EngineRequest factories the engine's tests share: greedy or seeded draws, stopping at an end token or
running to their limit."""

from deployments.messages.requests import EngineRequest, SamplingParams


def greedy(
    request_id: str, prompt: list[int], max_tokens: int | None = None, *, to_limit: bool = False, **fields: object
) -> EngineRequest:
    """Greedy draws; `to_limit`: end tokens do not end the reply (it runs to `max_tokens`)."""
    sampling = SamplingParams(temperature=0.0, ignore_eos=to_limit)
    return EngineRequest(request_id, prompt, sampling, max_tokens=max_tokens, **fields)  # type: ignore[arg-type]


def sampled(
    request_id: str,
    prompt: list[int],
    seed: int,
    temperature: float = 0.9,
    max_tokens: int | None = None,
    *,
    to_limit: bool = False,
    **fields: object,
) -> EngineRequest:
    """Keyed draws at `temperature` over the whole vocabulary; `to_limit` as for `greedy`."""
    sampling = SamplingParams(temperature=temperature, seed=seed, ignore_eos=to_limit)
    return EngineRequest(request_id, prompt, sampling, max_tokens=max_tokens, **fields)  # type: ignore[arg-type]

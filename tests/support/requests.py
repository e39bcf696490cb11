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


def alternating(
    prompts: list[list[int]], tag: str, max_tokens: int, *, top_p: float, seed_base: int
) -> list[EngineRequest]:
    """`tag-i` per prompt, running to `max_tokens`: greedy at even i, at odd i seeded draws at temperature
    0.8 with `top_p` (seed `seed_base + i`), so a batch mixes both kinds."""
    out = []
    for i, prompt in enumerate(prompts):
        sampling = (
            SamplingParams(temperature=0.0, ignore_eos=True)
            if i % 2 == 0
            else SamplingParams(temperature=0.8, top_p=top_p, seed=seed_base + i, ignore_eos=True)
        )
        out.append(EngineRequest(f"{tag}-{i}", prompt, sampling=sampling, max_tokens=max_tokens))
    return out


def reply_tokens(replies: dict, tag: str, count: int) -> list[list[int]]:
    """The token ids of replies `tag-0` .. `tag-(count - 1)`, in order."""
    return [replies[f"{tag}-{i}"].token_ids for i in range(count)]

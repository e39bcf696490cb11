"""OpenAI's chat completions and completions: request bodies, reply framing, logprobs, echo."""

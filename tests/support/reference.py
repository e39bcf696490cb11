"""transformers as the outside oracle: the reference model of a tiny checkpoint and its greedy continuation."""

import json
from pathlib import Path

import torch


def hf_model(path: Path):  # noqa: ANN201 (transformers is a test dependency, imported lazily)
    """transformers' model in float32 with eager attention; for a checkpoint with a vision tower the
    multimodal one (text-only input)."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    multimodal = "vision_config" in json.loads((Path(path) / "config.json").read_text())
    auto = transformers.AutoModelForImageTextToText if multimodal else transformers.AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_greedy(path: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt`, end tokens ignored."""
    with torch.no_grad():
        out = hf_model(path).generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()

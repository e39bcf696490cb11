"""`tensorfold fixture agent-checkpoint`: Qwen3's tokenizer, a 32k window, and replies that end.

The agents' round trips (tests/e2e/test_e2e_agents.py) rely on the model's replies ending within a few tokens
whatever the prompt: transformers' own forward pass on the written files must give the end token the
designed probability at every position of a random prompt.
"""

import json
from pathlib import Path

import pytest
import torch
import transformers

from serve_app.cli import main as cli_main
from serve_app.fixtures.agent_checkpoint import AGENT_WINDOW, END_PROBABILITY
from serve_app.fixtures.checkpoints import QWEN3_VOCAB


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("agent-model")
    assert cli_main(["fixture", "agent-checkpoint", str(out)]) == 0
    return out


def test_it_keeps_qwen3s_tokenizer_and_a_32k_window(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    assert config["max_position_embeddings"] == AGENT_WINDOW == 32768 and config["vocab_size"] == QWEN3_VOCAB
    assert config["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len(tokenizer("def main() -> None:\n    return").input_ids) == 8  # real BPE merges, not bytes


def test_every_position_ends_with_the_designed_probability(checkpoint: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompt = torch.randint(0, QWEN3_VOCAB, (1, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ends = model(prompt).logits[0].softmax(-1)[:, model.config.eos_token_id]
    assert ends.min() > END_PROBABILITY - 0.05 and ends.max() < END_PROBABILITY + 0.05

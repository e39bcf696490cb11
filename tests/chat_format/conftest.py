"""Fixtures shared by the chat-format tests."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def chatml_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small tokenizer with ChatML's control tokens and the think and tool markup as single ids."""
    from serve_app.fixtures.tokenizer_builder import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("chatml-tok"), vocab_size=512, family="qwen")

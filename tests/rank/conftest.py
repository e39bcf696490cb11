"""Fixtures the model-rank tests share."""

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module's tests: on two shared cores more threads only spin against other
    processes. (Modules that define their own `one_thread` use theirs.)"""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

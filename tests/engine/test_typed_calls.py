"""Typed calls (deployments/messages/calls.py): a call's arguments are checked when it is made, its reply
when it is taken, and a dispatcher refuses what is not one of its calls, each with a message naming it."""

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deployments.config import EngineConfig
from deployments.messages.engine_process import ForgetDisk, Imprint, MemorySnapshot
from deployments.messages.requests import ImprintQuery
from deployments.messages.slide import AddFact, CommitVersion, KeepVersions, SlideQuestion, TrainSteps
from deployments.messages.store import (
    DeleteSet,
    OpenSet,
    PieceWrite,
    ReadRows,
    ReadStats,
    StoreCall,
    StoreStats,
    StoreUnavailable,
)
from deployments.prompt_store.actor import PromptStoreActor
from deployments.prompt_store.links import LocalStoreLink
from deployments.prompt_store.store import PromptStoreFiles
from tests.engine.test_store_failures import BIG


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: CommitVersion("3", 1, "learned"), "CommitVersion.version must be int, not str"),
        (lambda: CommitVersion(True, 1, "learned"), "CommitVersion.version must be int, not bool"),
        (lambda: CommitVersion(3, 1, "learned", reason=4), "CommitVersion.reason must be str | None, not int"),
        (lambda: AddFact("a fact", ["a question"]), "AddFact.questions must be list[SlideQuestion], not list"),
        (lambda: ReadRows("s", [b"name", "name"]), "ReadRows.hashes must be list[bytes], not list"),
        (lambda: Imprint([1, 2, 3]), "Imprint.query must be ImprintQuery, not list"),
        (lambda: MemorySnapshot("yes"), "MemorySnapshot.reset_peak must be bool, not str"),
        (lambda: KeepVersions((1, 2)), "KeepVersions.versions must be list[int], not tuple"),
        (lambda: TrainSteps(2.5), "TrainSteps.count must be int, not float"),
    ],
)
def test_a_call_with_a_wrong_argument_is_refused_naming_the_field(make: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message.replace("|", r"\|").replace("[", r"\[").replace("]", r"\]")):
        make()


def test_a_well_typed_call_is_a_value() -> None:
    fact = AddFact("The capital of Zorbia is Quintar.", [SlideQuestion("Capital of Zorbia?", "Quintar")])
    assert fact == AddFact("The capital of Zorbia is Quintar.", [SlideQuestion("Capital of Zorbia?", "Quintar")])
    assert CommitVersion(3, 1, "learned", replica="r1").replica == "r1"
    assert Imprint(ImprintQuery([1, 2, 3])).query.prompt_token_ids == [1, 2, 3]


def test_a_reply_is_checked_against_its_calls_type() -> None:
    assert ForgetDisk().reply(4096) == 4096
    assert isinstance(ForgetDisk().reply(StoreUnavailable("down")), StoreUnavailable)
    with pytest.raises(TypeError, match=r"the answer to ForgetDisk must be int \| StoreUnavailable, not str"):
        ForgetDisk().reply("4096")
    with pytest.raises(TypeError, match="the answer to ReadStats must be StoreStats, not NoneType"):
        ReadStats("s").reply(None)
    assert ReadRows("s", []).reply(None) is None  # nothing held is an answer


def test_the_store_refuses_what_is_not_one_of_its_calls(tmp_path: Path) -> None:
    store = PromptStoreActor(str(tmp_path), BIG)
    assert store.answer(OpenSet("s")).blocks == []
    with pytest.raises(TypeError, match="not a prompt store call: ForgetDisk"):
        store.answer(ForgetDisk())  # type: ignore[arg-type]


def test_the_in_process_link_answers_typed_calls_and_checks_each_reply(tmp_path: Path) -> None:
    config = EngineConfig(model=str(tmp_path), learn_dir=str(tmp_path / "store"), learn_conversations=True)
    link = LocalStoreLink(config)
    assert link.ask(OpenSet("s")).blocks == []
    link.write(PieceWrite("s", None, [b"n" * 32], [[1, 2, 3, 4]], 8, np.arange(8, dtype=np.uint8)))
    assert link.ask(ReadStats("s")).pieces_written == 1
    assert link.ask(DeleteSet("s")) > 0
    reopened = PromptStoreFiles(tmp_path / "store", BIG)
    assert reopened.open_set("s").blocks == []

    class Confused(LocalStoreLink):
        def _carry(self, call: StoreCall[Any]) -> object:
            return StoreStats() if isinstance(call, OpenSet) else super()._carry(call)

    with pytest.raises(TypeError, match="the answer to OpenSet must be SetIndex, not StoreStats"):
        Confused(config).ask(OpenSet("s"))

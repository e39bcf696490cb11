"""The ResponseStore alone: newest entries kept, oldest evicted first by count and by bytes."""

from deployments.messages.responses import StoredResponse
from deployments.response_store.store import ResponseStore


def _entry(response_id: str, text: str = "") -> StoredResponse:
    return StoredResponse({"id": response_id, "object": "response", "text": text}, [{"role": "user", "content": text}])


def test_the_oldest_is_evicted_past_the_count() -> None:
    store = ResponseStore(max_responses=3)
    for i in range(5):
        assert store.save(_entry(f"resp_{i}"))
    assert len(store) == 3
    assert store.load("resp_0") is None and store.load("resp_1") is None
    assert store.load("resp_4") == _entry("resp_4")


def test_the_oldest_is_evicted_past_the_bytes() -> None:
    store = ResponseStore(max_bytes=1000)
    for i in range(4):
        store.save(_entry(f"resp_{i}", "x" * 300))
    assert store.bytes <= 1000 and len(store) < 4
    assert store.load("resp_3") is not None and store.load("resp_0") is None
    assert not store.save(_entry("resp_big", "x" * 2000))  # alone over the budget: not kept
    assert store.load("resp_big") is None and store.load("resp_3") is not None


def test_delete_and_resave_account_bytes() -> None:
    store = ResponseStore()
    store.save(_entry("resp_a", "hello"))
    size = store.bytes
    store.save(_entry("resp_a", "hello"))  # saving the same id again replaces it
    assert store.bytes == size and len(store) == 1
    loaded = store.load("resp_a")
    assert loaded is not None
    loaded.response["text"] = "changed"  # a reader's copy never changes the store
    assert store.load("resp_a") == _entry("resp_a", "hello")
    assert store.delete("resp_a") and not store.delete("resp_a")
    assert store.bytes == 0 and len(store) == 0

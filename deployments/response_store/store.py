"""Stored responses: the newest 1,024, up to 256 MiB of their JSON, oldest evicted first.

Each entry keeps the response body (what GET answers) and the conversation that continues it: the
messages it ran without its instructions, then its output as one assistant message. Entries are kept as
JSON text, so their size is exact and a reader never shares objects with the store.
"""

import json
from collections import OrderedDict

from deployments.messages.responses import StoredResponse

MAX_RESPONSES = 1024
MAX_BYTES = 256 * 1024 * 1024


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, bytes] = OrderedDict()  # oldest first
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def save(self, entry: StoredResponse) -> bool:
        """Keep `entry` as the newest; False when it alone is larger than the byte budget (not kept)."""
        data = json.dumps(
            {"response": entry.response, "messages": entry.messages}, ensure_ascii=False, separators=(",", ":")
        ).encode()
        self.delete(entry.response_id)
        if len(data) > self.max_bytes:
            return False
        self._entries[entry.response_id] = data
        self._bytes += len(data)
        while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= len(evicted)
        return True

    def load(self, response_id: str) -> StoredResponse | None:
        data = self._entries.get(response_id)
        if data is None:
            return None
        parsed = json.loads(data)
        return StoredResponse(parsed["response"], parsed["messages"])

    def delete(self, response_id: str) -> bool:
        data = self._entries.pop(response_id, None)
        if data is None:
            return False
        self._bytes -= len(data)
        return True

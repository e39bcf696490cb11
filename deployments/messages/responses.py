"""A stored Response, as Ingress saves it in the ResponseStore deployment and reads it back."""

from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the Response object as it was answered
    messages: list[dict[str, Any]]  # chat messages a continuation starts from

    @property
    def response_id(self) -> str:
        return str(self.response["id"])

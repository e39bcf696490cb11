"""The ResponseStore deployment: one replica holding stored responses for every Ingress replica.

Kept in memory only (docs/api.md: a restart forgets every response). One replica, so a response stored
through one Ingress replica is read, continued or deleted through any other.
"""

from ray import serve

from deployments.messages.responses import StoredResponse
from deployments.response_store.store import ResponseStore
from deployments.serve_sockets import configure_serve_sockets


@serve.deployment(name="ResponseStore", num_replicas=1, ray_actor_options={"num_cpus": 0.05}, max_ongoing_requests=1024)
class ResponseStoreDeployment:
    def __init__(self) -> None:
        configure_serve_sockets()  # before Serve binds this replica's gRPC server
        self._store = ResponseStore()

    async def save(self, entry: StoredResponse) -> bool:
        return self._store.save(entry)

    async def load(self, response_id: str) -> StoredResponse | None:
        return self._store.load(response_id)

    async def delete(self, response_id: str) -> bool:
        return self._store.delete(response_id)

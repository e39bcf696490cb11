"""The prefix-affinity router's in-flight counts, driven by Serve's own routing loop (its RequestRouter base,
with Serve's in-memory FakeRunningReplica): a request counts at its replica from its choice until Serve
reports it completed, or until its caller cancels it before it was sent, whenever that happens."""

import asyncio

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.test_utils import FakeRunningReplica

from deployments.messages.requests import EngineRequest
from deployments.routing.request_router import PrefixAffinityRouter


class Replica(FakeRunningReplica):
    routing_stats: dict = {}  # no report yet: the router goes by what it sent


def _router(*replicas: Replica) -> PrefixAffinityRouter:
    router = PrefixAffinityRouter(DeploymentID(name="Scheduler", app_name="t"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(block_size=4)
    router.update_replicas(list(replicas))
    return router


def _pending(index: int, internal_id: str | None = None) -> PendingRequest:
    request = EngineRequest(request_id=f"r{index}", prompt_token_ids=list(range(index, index + 12)))
    metadata = RequestMetadata(request_id=f"r{index}", internal_request_id=internal_id or f"i{index}")
    return PendingRequest(args=[request], kwargs={}, metadata=metadata)


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the router never got there"
        await asyncio.sleep(0.01)


def test_requests_cancelled_while_they_wait_for_a_full_replica_leave_no_count() -> None:
    async def scenario() -> None:
        replicas = [Replica(name, max_ongoing_requests=1) for name in ("a", "b")]
        for replica in replicas:
            replica.set_queue_len_response(1)  # at its limit: every request waits in Serve's backoff loop
        router = _router(*replicas)
        # Serve runs two routing tasks per replica: four requests are all chosen for, and all wait.
        waiting = [asyncio.create_task(router._choose_replica_for_request(_pending(i))) for i in range(4)]
        await _until(lambda: router.in_flight() == {"a": 2, "b": 2})  # no match: the least loaded takes each
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert router.in_flight() == {"a": 0, "b": 0}

    asyncio.run(scenario())


def test_a_request_cancelled_after_its_replica_was_chosen_but_before_it_was_sent_leaves_no_count() -> None:
    async def scenario() -> None:
        free = Replica("free")
        free.set_queue_len_response(0)
        router = _router(free)
        pending = _pending(0)
        caller: list[asyncio.Task] = []
        # Serve resolves the future with the replica; this callback, registered before the caller awaits it,
        # cancels the caller before it resumes to send the request.
        pending.future.add_done_callback(lambda _: caller[0].cancel())
        caller.append(asyncio.create_task(router._choose_replica_for_request(pending)))
        (outcome,) = await asyncio.gather(caller[0], return_exceptions=True)
        assert isinstance(outcome, asyncio.CancelledError) and pending.future.result() is free
        assert router.in_flight() == {"free": 0}

    asyncio.run(scenario())


def test_a_sent_request_counts_until_serve_reports_it_completed_and_each_retry_counts_once() -> None:
    async def scenario() -> None:
        free = Replica("free")
        free.set_queue_len_response(0)
        router = _router(free)
        pending = _pending(0)
        assert await router._choose_replica_for_request(pending) is free
        assert router.in_flight() == {"free": 1}
        pending.reset_future()  # the replica rejected it: Serve routes the same request again
        assert await router._choose_replica_for_request(pending, is_retry=True) is free
        assert router.in_flight() == {"free": 2}  # the rejected attempt is reported completed later
        router.on_request_completed(free.replica_id, "i0")
        assert router.in_flight() == {"free": 1}
        router.on_request_completed(free.replica_id, "i0")
        router.on_request_completed(free.replica_id, "i0")  # one report too many changes nothing
        assert router.in_flight() == {"free": 0}

    asyncio.run(scenario())

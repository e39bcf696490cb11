"""The PromptStore actor: one per node, named for its node and pinned to it, shared by every Scheduler
replica there. It owns the learn folder and does every disk read and write; the Schedulers decide what to
write and whether to restore. Its calls run one at a time, so a read waits for at most one piece's write.
"""

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deployments.messages.store import (
    DeleteSet,
    LookUp,
    OpenSet,
    ReadRows,
    ReadStats,
    StoreCall,
    StoreCaps,
    WritePiece,
)
from deployments.prompt_store.store import PromptStoreFiles

if TYPE_CHECKING:
    import ray

log = logging.getLogger("tensorfold.store")
ACTOR_CPUS = 0.05  # it mostly waits on the disk
STORE_NAMESPACE = "tensorfold"


class PromptStoreActor:
    """The store's one entry (also used in-process: links.LocalStoreLink): each call is one disk operation."""

    def __init__(self, root: str, caps: StoreCaps) -> None:
        self._files = PromptStoreFiles(Path(root), caps)

    def answer(self, call: StoreCall[Any]) -> object:
        """The call's reply (`call.reply` checks it where it is taken)."""
        files = self._files
        match call:
            case OpenSet(set_id=set_id):
                return files.open_set(set_id)
            case WritePiece(piece=piece):
                return files.write(piece)
            case ReadRows(set_id=set_id, hashes=hashes, state_at=state_at):
                return files.read(set_id, hashes, state_at)
            case LookUp(set_id=set_id, hashes=hashes, with_states=with_states):
                return files.lookup(set_id, hashes, with_states)
            case DeleteSet(set_id=set_id):
                return files.delete_set(set_id)
            case ReadStats(set_id=set_id):
                return files.stats(set_id)
        raise TypeError(f"not a prompt store call: {type(call).__name__}")


def store_actor(root: str, caps: StoreCaps) -> "ray.actor.ActorHandle":
    """This node's store actor, started on first use (a detached actor, so replicas come and go under it).
    Ray restarts it after a crash, under the same name and handle, and the restarted one rebuilds each
    set's index from the folder (store.py); a caller whose actor is gone for good gets a new one here."""
    import ray  # here: the engine imports this module, and runs offline without Ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = ray.get_runtime_context().get_node_id()
    remote = ray.remote(PromptStoreActor).options(
        name=store_actor_name(node_id, root),
        namespace=STORE_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        max_restarts=-1,  # every crash: its state is the folder, which a new process reopens
        num_cpus=ACTOR_CPUS,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    )
    return remote.remote(root, caps)


def store_actor_name(node_id: str, root: str) -> str:
    return f"tensorfold-prompt-store-{node_id[:16]}-{_folder_tag(root)}"


def _folder_tag(root: str) -> str:
    """One actor per node and learn folder: two servers with different folders must not share one."""
    import hashlib

    return hashlib.sha256(str(Path(root).expanduser().resolve()).encode()).hexdigest()[:8]

"""A learn folder several nodes' stores write to (`learn_shared`, shared storage): blocks another node wrote
are found there before a prompt prefills.

A store's index holds what
the folder held when it was opened and what the store wrote since, so a block it lacks is looked for in the
folder before the prompt prefills. Pieces are named by their first block, and a store that did not know
another's piece may rewrite a longer run of the same chain under the same name: both are checked.
"""

import time

from deployments.messages.store import SetIndex
from deployments.prompt_store.entries import Piece, SetEntry, StateFile
from deployments.prompt_store.files import PIECE_SUFFIX, STATE_SUFFIX, DamagedPiece, read_header


def look_in_folder(entry: SetEntry, hashes: list[bytes], with_states: bool) -> SetIndex:
    """The leading run of `hashes` the set holds, indexing the pieces other stores wrote on the way (a
    file check or two per block the index lacks); with_states: and the snapshots at them."""
    found: list[bytes] = []
    for name in hashes:
        if name not in entry.blocks and not _adopt_piece(entry, name, found[-1] if found else None):
            break
        found.append(name)
    if not with_states:
        return SetIndex(found, [])
    return SetIndex(found, [name for name in found if name in entry.states or _adopt_state(entry, name)])


def _adopt_piece(entry: SetEntry, name: bytes, previous: bytes | None) -> bool:
    """Index the piece holding block `name` that another store wrote: the one named by it, or the piece
    holding `previous` rewritten longer under its name."""
    candidates = [entry.folder / f"{name.hex()}{PIECE_SUFFIX}"]
    if previous is not None:
        candidates.append(entry.pieces[entry.blocks[previous][0]].path)
    for path in candidates:
        known = entry.pieces.get(path.name)
        try:
            size = path.stat().st_size
            if known is not None and known.size == size:
                continue  # the same run: a piece's first block and size decide its blocks
            header = read_header(path)
        except (OSError, DamagedPiece):
            continue  # gone meanwhile, or half-read: this prompt prefills what it cannot find
        if known is not None:
            entry.forget(path.name)
        entry.add(Piece(path, header.parent, header.hashes, size, time.time()))
        if name in entry.blocks:
            return True
    return False


def _adopt_state(entry: SetEntry, name: bytes) -> bool:
    path = entry.folder / f"{name.hex()}{STATE_SUFFIX}"
    try:
        if read_header(path).hashes != [name]:
            return False
        entry.states[name] = StateFile(path, path.stat().st_size)
    except (OSError, DamagedPiece, ValueError):
        return False
    entry.stats.bytes_held += entry.states[name].size
    return True

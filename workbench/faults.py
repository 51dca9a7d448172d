"""The faults `/fault NAME` injects into a live chat: every drill of engine/cache/faults.py that
works on a live cache, plus two of the workbench's own disk tier (a failed read, a flipped byte
in a stored blob). Each takes the session and the current conversation's cached records, damages
them, and returns how many pieces it damaged; the next turn shows the validator catching it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.cache.faults import DRILLS

if TYPE_CHECKING:
    from workbench.session import ChatSession


def _disk_read_error(session: ChatSession, records) -> int:
    """The next disk read fails with an I/O error (once); memory is emptied so the turn must read."""
    session.save()
    session.cache.forget_memory()  # the turn must read from disk

    def fail_once(key: str) -> None:
        session.tier.read_hook = None
        raise OSError(5, "injected read error (EIO)")
    session.tier.read_hook = fail_once
    return 1


def _disk_corrupt_blob(session: ChatSession, records) -> int:
    """One stored blob of the middle segment gets a flipped byte; memory is emptied."""
    session.save()
    session.cache.forget_memory()  # the turn must read from disk
    key = records[len(records) // 2].key.hex()
    row = session.tier.db.execute("SELECT id, data FROM blobs WHERE segment = ? ORDER BY id LIMIT 1", [key]).fetchone()
    if row is None:
        return 0
    data = bytearray(row[1])
    data[len(data) // 2] ^= 0x40
    with session.tier.db.conn:
        session.tier.db.execute("UPDATE blobs SET data = ? WHERE id = ?", [bytes(data), row[0]])
    return 1


def _on_cache(drill: Callable) -> Callable:
    return lambda session, records: drill(session.cache, records)


# every drill that works on a live cache, plus the disk faults of the workbench's own tier
FAULTS: dict[str, Callable] = {name: _on_cache(drill) for name, drill in DRILLS.items()
                               if name not in ("fail_lower_read", "delay_lower_read")}  # those need MemoryTier
FAULTS["disk_read_error"] = _disk_read_error
FAULTS["disk_corrupt_blob"] = _disk_corrupt_blob


def fault_names() -> list[str]:
    return [name.replace("_", "-") for name in FAULTS]

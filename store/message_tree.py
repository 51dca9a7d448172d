"""Walks of the message tree, each bounded so that damaged rows (a cycle, a missing parent, a
message of another conversation) end it: a thread's path, which raises ConversationDamaged rather
than return a shorter history; a conversation's tree, which hangs what it cannot place as a root
marked "damaged"; `walk` over that tree without recursion; the cycles among a set of rows."""

from __future__ import annotations

from collections.abc import Iterator

import sqlite_utils

from store.conversation_rows import CHANGED, COLUMNS, addressed, message_from_row, unbuildable
from store.conversation_types import ConversationDamaged, Message, Thread


def path_of(db: sqlite_utils.Database, thread: Thread) -> list[Message]:
    """`Conversations.path` of a thread already read."""
    if thread.tip is None:
        return []
    conv = thread.conversation
    cols = ", ".join(f"m.{c}" for c in COLUMNS)
    rows = db.execute(
        "WITH RECURSIVE up(id, depth) AS (SELECT ?, 0 UNION ALL SELECT m.parent, up.depth + 1 "
        "FROM up JOIN messages m ON m.id = up.id WHERE m.conversation = ? AND m.parent IS NOT NULL "
        "AND up.depth < (SELECT count(*) FROM messages WHERE conversation = ?)) "
        f"SELECT up.id, {cols} FROM up LEFT JOIN messages m ON m.id = up.id ORDER BY up.depth",
        [thread.tip, conv, conv]).fetchall()
    out: list[Message] = []  # tip first
    seen: set[str] = set()
    changed: tuple[str, list[Message]] | None = None  # the first row whose id is not its digest
    for at, *values in rows:
        row = dict(zip(COLUMNS, values))
        where = f"message {out[-1].id}'s parent {at}" if out else f"its tip {at}"
        if row["id"] is None:
            raise damaged(thread, f"{where} is missing", out, at)
        if row["conversation"] != conv:
            raise damaged(thread, f"{where} belongs to conversation {row['conversation']}", out, at)
        if at in seen:
            raise damaged(thread, f"{where} is already on the path: the parents form a cycle", out, at,
                          intact=f"the {len(out)} messages from {out[-1].id} to the tip have no root")
        seen.add(at)
        bad = unbuildable(row)
        if bad:
            raise damaged(thread, f"message {at}: {'; '.join(bad)}", out, at)
        if changed is None and not addressed(row):
            changed = at, list(out)  # named after the walk, unless it meets worse: a cycle, a gap
        out.append(message_from_row(row))
    if out and out[-1].parent is not None:  # the bound stopped the walk: never a shortened history
        raise damaged(thread, f"message {out[-1].id}'s parent {out[-1].parent} was not reached", out,
                      out[-1].parent)
    if changed is not None:  # a parent set to NULL or to another message: a cut or spliced history
        raise damaged(thread, f"message {changed[0]}: {CHANGED}", changed[1], changed[0])
    out.reverse()
    return out


def tree_of(db: sqlite_utils.Database, conversation_id: str, tips: dict[str, list[str]]) -> list[dict]:
    """`Conversations.tree`; `tips`: message id -> the names of the threads whose tip it is."""
    nodes: dict[str, dict] = {}
    unreadable: set[str] = set()
    for r in db.query("SELECT * FROM messages WHERE conversation = ? ORDER BY rowid", [conversation_id]):
        try:
            m = message_from_row(r)
        except ConversationDamaged:
            unreadable.add(r["id"])
            continue
        nodes[m.id] = {"message": m, "children": [], "threads": tips.get(m.id, []),
                       "damaged": None if addressed(r) else CHANGED}
    roots = _hang(db, nodes, unreadable)
    _break_cycles(nodes, roots)
    return roots


def _hang(db: sqlite_utils.Database, nodes: dict[str, dict], unreadable: set[str]) -> list[dict]:
    """Each node under its parent; the roots: those without one, and those whose parent is not a
    readable message of this conversation (marked damaged)."""
    roots = []
    lost = {n["message"].parent for n in nodes.values()} - set(nodes) - unreadable - {None}
    owner = owners(db, lost)
    for node in nodes.values():
        parent = node["message"].parent
        if parent in nodes:
            nodes[parent]["children"].append(node)
            continue
        if parent is not None:
            node["damaged"] = also(node["damaged"], (
                f"parent {parent} is not a readable message" if parent in unreadable else
                f"parent {parent} belongs to conversation {owner[parent]}" if parent in owner
                else f"parent {parent} is missing"))
        roots.append(node)
    return roots


def _break_cycles(nodes: dict[str, dict], roots: list[dict]) -> None:
    """What no root reaches hangs off a cycle: break each at its oldest message, a new root."""
    reached = {n["message"].id for _, n in walk(roots)}
    order = {id: i for i, id in enumerate(nodes)}
    for id in nodes:
        if id in reached:
            continue
        chain: dict[str, int] = {}  # an unreached message's parent is unreached too: this meets a cycle
        at = id
        while at not in chain:
            chain[at] = len(chain)
            at = nodes[at]["message"].parent
        cycle = list(chain)[chain[at]:]
        oldest = nodes[min(cycle, key=order.__getitem__)]
        parent = oldest["message"].parent
        nodes[parent]["children"].remove(oldest)
        oldest["damaged"] = also(oldest["damaged"], f"parent {parent} is a descendant of it: the parents form a cycle")
        roots.append(oldest)
        reached.update(n["message"].id for _, n in walk([oldest]))


def walk(tree: list[dict]) -> Iterator[tuple[int, dict]]:
    """(depth, node) for every node of `Conversations.tree`, parents before children, without
    recursion. Each node once: a hand-made tree that holds a node twice (or in a loop) still ends."""
    stack = [(0, node) for node in reversed(tree)]
    seen: set[int] = set()
    while stack:
        depth, node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield depth, node
        stack.extend((depth + 1, child) for child in reversed(node["children"]))


def cycles(rows: list[dict]) -> list[str]:
    """One finding per cycle of parent links among `rows` (links into another conversation end a
    walk: they are findings of their own)."""
    parent = {r["id"]: r["parent"] for r in rows}
    conv = {r["id"]: r["conversation"] for r in rows}
    done: set[str] = set()
    findings = []
    for start in parent:
        walked: dict[str, int] = {}
        at = start
        while at is not None and at in parent and at not in done and at not in walked \
                and conv[at] == conv[start]:
            walked[at] = len(walked)
            at = parent[at]
        if at in walked:
            cycle = list(walked)[walked[at]:]
            what = (f"message {at} is its own parent" if len(cycle) == 1 else
                    f"messages {', '.join(map(str, cycle))} form a cycle (each one's parent is the next, the last's "
                    "the first)")
            findings.append(f"conversation {conv[at]}: {what}")
        done.update(walked)
    return findings


def owners(db: sqlite_utils.Database, ids: set[str]) -> dict[str, str]:
    """message id -> its conversation, for those of `ids` that exist."""
    ids, out = sorted(ids, key=str), {}
    for at in range(0, len(ids), 500):
        chunk = ids[at:at + 500]
        out.update(db.execute(f"SELECT id, conversation FROM messages WHERE id IN "
                              f"({', '.join('?' * len(chunk))})", chunk).fetchall())
    return out


def damaged(thread: Thread, what: str, found: list[Message], at: str | None,
            intact: str | None = None) -> ConversationDamaged:
    """`found`: the messages read from the tip down to the damage."""
    if intact is None:
        n = len(found)
        intact = f"{n} intact message{'s' * (n != 1)} from {found[-1].id} to the tip" if found else \
            "no intact message"
    c = thread.conversation
    return ConversationDamaged(f"conversation {c}: thread {thread.name}: {what} ({intact})", c, at,
                               hint=f"`hcw inspect --session {c}` shows the tree")


def also(damage: str | None, why: str) -> str:
    return why if damage is None else f"{damage}; {why}"

"""`hcw inspect`: what the workbench database holds, and with --verify whether all of it is sound;
with --session, one conversation: its branches and its message tree.

--verify names every finding, one line each, in what the chat can meet: segment rows that do not
parse (tokens a whole block of int64 ids, hex keys, a non-negative index, JSON presence), chains
that are not whole (each segment's parent is the segment before it, and its key recomputes from
parent, the layout's model identity and tokens as engine/cache/prefix_index.py's `segment_hash`
does), blobs that do not
verify (`DiskTier.load`), conversation trees (`Conversations.check`), `PRAGMA integrity_check` and
`foreign_key_check`. A file that SQLite cannot read is one error line, never a traceback."""

from __future__ import annotations

import collections
import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

import sqlite_utils
import xxhash

from store.conversations import ConversationDamaged, Conversations, model_label, walk
from store.db import default_home, open_db
from store.tier import IDENTITY_BYTES, LAYOUT_BYTES, DiskTier

# a first segment's parent (engine/cache/prefix_index.py: ROOT)
ROOT = "00" * 16
_SQLITE_MAGIC = b"SQLite format 3\x00"
_HEX = frozenset("0123456789abcdef")
_DEFAULT = " (the default file; name another to read it)"
# their foreign keys are what `Conversations.check` names, by id and in words
_CONVERSATION_TABLES = {"conversations", "messages", "threads"}


class DatabaseUnreadable(ValueError):
    """The file cannot be read as a workbench database; the message is one line saying why."""


def default_db() -> Path:
    """The workbench file every command uses without --db: $HCW_HOME/hcw.db, else
    $XDG_DATA_HOME/hcw/hcw.db, else ~/.local/share/hcw/hcw.db."""
    return default_home() / "hcw.db"


def existing(db_path: Path | None) -> Path:
    """The file `db_path` (default: `default_db()`), checked to be a workbench database before
    anything opens it: ValueError when there is none, DatabaseUnreadable when it is not one."""
    path = Path(db_path or default_db())
    if not path.is_file():
        raise ValueError(f"no workbench database at {path}")
    _check_file(path)
    return path


@contextmanager
def reading(path: Path) -> Iterator[sqlite_utils.Database]:
    """The checked file (`existing`) opened; an SQLite error while it is read is DatabaseUnreadable."""
    db = _opened(path, open_db)
    try:
        yield db
    except sqlite3.DatabaseError as e:
        raise _unreadable(path, e) from None
    finally:
        db.close()


def inspect(db_path: Path | None, verify: bool, gc: bool, as_json: bool, out: TextIO,
            session: str | None = None) -> bool:
    """Print the report; return True when --verify (or --session, of its conversation) found
    anything bad. DatabaseUnreadable when the file is not a workbench database SQLite can read."""
    path = existing(db_path)
    try:
        if session is not None:
            return _session(path, session, as_json, out, db_path is None)
        return _report(path, verify, gc, as_json, out, db_path is None)
    except sqlite3.DatabaseError as e:
        raise _unreadable(path, e) from None


# SQLite's primary result codes that say nothing about the file's contents: permission, busy,
# locked, out of memory, read-only, I/O error, disk full, cannot open
_NOT_THE_FILE = {3, 5, 6, 7, 8, 10, 13, 14}


def _unreadable(path: Path, e: sqlite3.DatabaseError, doing: str = "") -> DatabaseUnreadable:
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None and code & 0xFF in _NOT_THE_FILE:  # the file may be sound
        return DatabaseUnreadable(f"cannot read {path} ({doing}{e})")
    return DatabaseUnreadable(f"{path} is not a workbench database ({doing}{e})")


def _check_file(path: Path) -> None:
    """What SQLite would take for a new database (an empty file) or would read past (a truncated
    one), or that is another program's SQLite file, is refused before it is opened for writing."""
    def unreadable(why: str) -> DatabaseUnreadable:
        return DatabaseUnreadable(f"{path} is not a workbench database ({why})")

    size = path.stat().st_size
    if size == 0:
        raise unreadable("the file is empty")
    with open(path, "rb") as f:
        head = f.read(100)
    if not head.startswith(_SQLITE_MAGIC):
        raise unreadable("not an SQLite file")
    if len(head) < 100:
        raise unreadable(f"truncated: {size} bytes, shorter than the header")
    page = int.from_bytes(head[16:18], "big")
    page = 65536 if page == 1 else page
    pages = int.from_bytes(head[28:32], "big")
    # the header's page count is valid when its version-valid-for number equals the change counter
    if head[24:28] == head[92:96] and size < page * pages:
        raise unreadable(f"truncated: {size} bytes, the header says {pages} pages of {page} bytes")
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            tables = {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        raise _unreadable(path, e) from None
    if "segments" not in tables:
        raise unreadable("an SQLite file without the workbench's tables")


def _opened(path: Path, open_):
    """open_(path), its failure named as such: opening migrates, and a damaged record of the
    migrations applied makes one try to create a table that exists."""
    try:
        return open_(path)
    except sqlite3.DatabaseError as e:
        raise _unreadable(path, e, "opening it: ") from None


def _report(path: Path, verify: bool, gc: bool, as_json: bool, out: TextIO, default: bool) -> bool:
    tier = _opened(path, DiskTier)
    try:
        return _written(tier, path, verify, gc, as_json, out, default)
    finally:
        tier.close()


def _written(tier: DiskTier, path: Path, verify: bool, gc: bool, as_json: bool, out: TextIO, default: bool) -> bool:
    db = tier.db
    removed = _gc(db) if gc else 0
    by_kind = {str(kind): {"blobs": n, "stored_bytes": stored or 0, "raw_bytes": raw or 0}
               for kind, n, stored, raw in db.execute(
                   "SELECT kind, count(*), sum(length), sum(raw_len) FROM blobs GROUP BY kind ORDER BY kind")}
    layouts = {layout: n for layout, n in db.execute("SELECT layout, count(*) FROM segments GROUP BY layout")}
    report = {
        "db": str(path),
        "models": db["models"].count,
        "segments": db["segments"].count,
        # a layout by its identity's first 8 bytes, and its weights format's first 4 where it has one
        "layouts": {str(k)[:16] + (f".{k[2 * IDENTITY_BYTES:2 * IDENTITY_BYTES + 8]}" if len(str(k)) == 2 * LAYOUT_BYTES
                                   else ""): v for k, v in layouts.items()},
        "by_kind": {k: {**v, "ratio": (v["raw_bytes"] / v["stored_bytes"]) if v["stored_bytes"] else None}
                    for k, v in by_kind.items()},
        "gc_removed": removed,
        "conversations": _listing(db),
    }
    findings: list[str] = []
    if verify:
        bad, integrity = _verify(tier, findings)
        report["verify"] = {"checked": report["segments"], "bad": bad, "integrity_check": integrity,
                            "findings": findings}
    report["findings"] = findings
    if as_json:
        out.write(json.dumps(report, default=str) + "\n")
        return bool(findings)
    out.write(f"workbench file {report['db']}{_DEFAULT if default else ''}\n  models: {report['models']}  "
              f"segments: {report['segments']}  layouts: {len(layouts)}\n")
    out.write(f"  {'state kind':16} {'blobs':>7} {'stored MiB':>11} {'raw MiB':>9} {'ratio':>6}\n")
    for kind, v in report["by_kind"].items():
        ratio = f"{v['ratio']:.2f}" if v["ratio"] else "-"
        out.write(f"  {kind:16} {v['blobs']:7d} {v['stored_bytes'] / 2**20:11.3f} {v['raw_bytes'] / 2**20:9.3f} "
                  f"{ratio:>6}\n")
    if gc:
        out.write(f"  gc: removed {removed} unreachable segment(s)\n")
    out.write(f"  conversations: {len(report['conversations'])}\n")
    for c in report["conversations"]:
        out.write(f"    {c['id']}  {_title(c['title'])}  {c['model'] or '-'}  {c['messages']} messages  "
                  f"{_count(c['branches'], 'branch', 'branches')}  updated {str(c['updated'])[:19]}\n")
    if verify:
        v = report["verify"]
        out.write(f"  verify: {len(v['bad'])} bad of {v['checked']} segments; integrity_check "
                  f"{v['integrity_check']}; {len(findings)} finding(s)\n")
        for line in findings:
            out.write(f"    {line}\n")
    return bool(findings)


def _verify(tier: DiskTier, findings: list[str]) -> tuple[list[dict], str]:
    """Every check, each finding appended to `findings`: (segments whose blobs do not load, with
    why; integrity_check's first line). A table SQLite cannot read is a finding too."""
    db = tier.db
    bad: list[dict] = []

    def step(what: str, check) -> None:
        try:
            check()
        except sqlite3.DatabaseError as e:
            findings.append(f"{what}: {e}")

    def blobs() -> None:
        for key, layout in db.execute("SELECT key, layout FROM segments ORDER BY idx").fetchall():
            if not _is_hex(key, 32):
                continue  # a finding of the row's own
            tier.layout = layout  # verify each row against the layout it claims
            pieces, why = tier.load(bytes.fromhex(key))
            if pieces is None:
                bad.append({"segment": key, "reason": why})
                findings.append(f"segment {key}: {why}")

    def integrity() -> None:
        nonlocal verdict
        verdict = "failed"  # (what it raised is the finding)
        lines = [line for (line,) in db.execute("PRAGMA integrity_check")]
        verdict = lines[0] if lines else "no answer"
        if lines != ["ok"]:
            findings.extend(f"integrity_check: {line}" for line in lines)

    def foreign_keys() -> None:
        for table, rowid, parent, _ in db.execute("PRAGMA foreign_key_check").fetchall():
            if table not in _CONVERSATION_TABLES:
                findings.append(f"foreign_key_check: {table} row {rowid} refers to a missing {parent} row")

    verdict = "not run"
    step("reading the segments", lambda: findings.extend(_segment_findings(db)))
    step("reading the blobs", blobs)
    step("reading the conversations", lambda: findings.extend(Conversations(db).check()))
    step("integrity_check", integrity)
    step("foreign_key_check", foreign_keys)
    return bad, verdict


def _segment_findings(db) -> list[str]:
    """Segment rows that do not parse, chains that are not whole, keys that do not recompute."""
    rows = db.execute("SELECT rowid, key, parent, idx, layout, tokens, presence FROM segments "
                      "ORDER BY rowid").fetchall()
    # a layout's block size: the most common token-blob length among its rows
    lengths: dict[object, collections.Counter] = collections.defaultdict(collections.Counter)
    for *_, layout, tokens, _ in rows:
        if isinstance(tokens, bytes):
            lengths[layout][len(tokens)] += 1
    block = {layout: counts.most_common(1)[0][0] for layout, counts in lengths.items()}
    # keys chain the model's identity, a layout's first 16 bytes (engine/cache/prefix_cache.py's
    # layout_identity): a chain may pass from one weights format's rows to another's
    position = {key: (idx, _identity(layout)) for _, key, _, idx, layout, _, _ in rows}
    findings = []
    for rowid, key, parent, idx, layout, tokens, presence in rows:
        why = []
        if not _is_hex(key, 32):
            why.append(f"key {key!r} is not 32 hex digits")
        if not _is_hex(parent, 32):
            why.append(f"parent {parent!r} is not 32 hex digits")
        if type(idx) is not int or idx < 0:
            why.append(f"idx {idx!r} is not a non-negative integer")
        if not _is_hex(layout):
            why.append(f"layout {layout!r} is not hex")
        if not isinstance(tokens, bytes):
            why.append(f"tokens is {'NULL' if tokens is None else type(tokens).__name__}, not bytes")
        elif not tokens or len(tokens) % 8:
            why.append(f"tokens hold {len(tokens)} bytes, not a whole number of int64 token ids")
        elif len(tokens) != block[layout]:
            why.append(f"tokens hold {len(tokens)} bytes, most segments of its layout {block[layout]} "
                       f"(a block of {block[layout] // 8} tokens)")
        try:
            if not isinstance(json.loads(presence), dict):
                why.append("presence is not a JSON object")
        except (TypeError, ValueError):
            why.append("presence is not JSON")
        if not why:
            if idx == 0 and parent != ROOT:
                why.append(f"a first segment's parent is {parent}, not the root")
            elif idx > 0 and parent not in position:
                why.append(f"parent {parent} is missing: the chain before segment {idx} is broken")
            elif idx > 0 and position[parent] != (idx - 1, _identity(layout)):
                why.append(f"parent {parent} is not segment {idx - 1} of its layout")
            if xxhash.xxh3_128_hexdigest(bytes.fromhex(parent) + bytes.fromhex(_identity(layout)) + tokens) != key:
                why.append("key does not recompute from its parent, layout and tokens")
        name = f"segment {key}" if isinstance(key, str) else f"segment row {rowid}"
        findings.extend(f"{name}: {w}" for w in why)
    return findings


def _identity(layout):
    return layout[:2 * IDENTITY_BYTES] if isinstance(layout, str) else layout


def _is_hex(value, length: int | None = None) -> bool:
    return (isinstance(value, str) and not set(value) - _HEX and len(value) % 2 == 0
            and (length is None or len(value) == length))


def _listing(db) -> list[dict]:
    """Every conversation, most recently updated first, as `Conversations.recent` lists them (a
    damaged row is listed too)."""
    n = db.execute("SELECT count(*) FROM conversations").fetchone()[0]
    return Conversations(db).recent(n) if n else []


def _session(path: Path, session: str, as_json: bool, out: TextIO, default: bool) -> bool:
    """One conversation's branches (threads) and tree, and every finding in its rows (then True)."""
    with reading(path) as db:
        convs = Conversations(db)
        try:
            conv = convs.conversation(convs.resolve("conversation", session))
        except KeyError as e:
            raise ValueError(e.args[0]) from None
        threads = []
        for t in convs.threads(conv.id):
            try:
                threads.append((t, len(convs.path(t.id))))
            except (ConversationDamaged, KeyError):  # among the findings below (KeyError: an id that is not one)
                threads.append((t, None))
        rows = list(_tree_rows(convs.tree(conv.id)))
        findings = convs.check(conv.id)
    if as_json:
        out.write(json.dumps({
            "db": str(path), "conversation": asdict(conv),
            "threads": [{**asdict(t), "messages": n} for t, n in threads],
            # flat, parents first: a long chat nests deeper than a JSON encoder recurses
            "messages": [{**asdict(node["message"]), "depth": depth, "tip_of": node["threads"],
                          "damaged": node["damaged"]} for depth, _, node in rows],
            "findings": findings,
        }, default=str) + "\n")
        return bool(findings)
    if default:
        out.write(f"workbench file {path}{_DEFAULT}\n")
    model = model_label(conv.model_name, conv.model) or "-"
    out.write(f"conversation {conv.id}  {_title(conv.title)}  model {model}  updated {str(conv.updated)[:19]}\n"
              "  branches:\n")
    for t, n in threads:
        fork = f"  forked from {str(t.forked_from)[:8]}" if t.forked_from else ""
        count = f"{n} messages" if n is not None else "damaged"
        out.write(f"    {t.id}  {str(t.name):12} tip {str(t.tip or '-')[:8]:8}  {count}{fork}\n")
    out.write("  tree:\n")
    for _, lead, node in rows:
        m = node["message"]
        text = " ".join(m.content.split())
        text = text if len(text) <= 60 else text[:59] + "…"
        tokens = f"{m.tokens} tok" if m.tokens is not None else "- tok"
        tips = f"  <- {', '.join(map(str, node['threads']))}" if node["threads"] else ""
        damaged = f"  (damaged: {node['damaged']})" if node["damaged"] else ""
        out.write(f"    {lead}{m.id[:8]} {m.role:9} {json.dumps(text, ensure_ascii=False)}  {tokens}{tips}"
                  f"{damaged}\n")
    if findings:
        out.write(f"  damage: {len(findings)} finding(s)\n")
        for line in findings:
            out.write(f"    {line}\n")
    return bool(findings)


def _tree_rows(tree: list[dict]):
    """(depth, lead, node): a chain keeps its column and only a branch point indents, so a long chat
    stays readable; siblings hang under their parent on ├─ / └─."""
    # message id -> (its own lead, the lead its descendants go on with)
    leads: dict[str, tuple[str, str]] = {}

    def hang(kids: list[dict], rest: str) -> None:
        for i, child in enumerate(kids):
            last = i == len(kids) - 1
            leads[child["message"].id] = ((rest, rest) if len(kids) == 1 else
                                          (rest + ("└─ " if last else "├─ "), rest + ("   " if last else "│  ")))

    hang(tree, "")
    for depth, node in walk(tree):
        lead, rest = leads.pop(node["message"].id)
        yield depth, lead, node
        hang(node["children"], rest)


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _title(title: str | None) -> str:
    return json.dumps(title if isinstance(title, str) else repr(title), ensure_ascii=False) if title else "(untitled)"


def _gc(db) -> int:
    """Remove segments no version of hcw reads any more (a layout of 16 bytes: written before the
    fingerprint named the weights' format) and those no chain from a first segment reaches
    (their parent is gone), repeatedly."""
    old = db.execute("SELECT rowid, key FROM segments WHERE length(layout) = ?", [2 * IDENTITY_BYTES]).fetchall()
    with db.conn:
        for rowid, key in old:
            db.execute("DELETE FROM blobs WHERE segment = ?", [key])
            db.execute("DELETE FROM segments WHERE rowid = ?", [rowid])
    removed = len(old)
    while True:
        # by rowid: a damaged key (NULL, say) matches nothing by `key = ?`, and would be found again forever
        orphans = db.execute(
            "SELECT s.rowid, s.key FROM segments s WHERE s.idx > 0 AND NOT EXISTS "
            "(SELECT 1 FROM segments p WHERE p.key = s.parent)").fetchall()
        if not orphans:
            return removed
        with db.conn:
            for rowid, key in orphans:
                if key is not None:
                    db.execute("DELETE FROM blobs WHERE segment = ?", [key])
                db.execute("DELETE FROM segments WHERE rowid = ?", [rowid])
        removed += len(orphans)

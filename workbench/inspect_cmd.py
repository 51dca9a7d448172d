"""`hcw inspect`: what the workbench database holds, and with --verify whether all of it is sound;
with --session, one conversation: its threads and its branch tree."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

from store.conversations import Conversations, walk
from store.db import default_home, open_db
from store.tier import DiskTier


def inspect(db_path: Path | None, verify: bool, gc: bool, as_json: bool, out: TextIO,
            session: str | None = None) -> bool:
    """Print the report; return True when --verify found anything bad."""
    path = db_path or default_home() / "hcw.db"
    if not Path(path).is_file():
        raise ValueError(f"no workbench database at {path}")
    if session is not None:
        _session(path, session, as_json, out)
        return False
    tier = DiskTier(path)
    db = tier.db
    removed = _gc(db) if gc else 0
    by_kind = {kind: {"blobs": n, "stored_bytes": stored or 0, "raw_bytes": raw or 0}
               for kind, n, stored, raw in db.execute(
                   "SELECT kind, count(*), sum(length), sum(raw_len) FROM blobs GROUP BY kind ORDER BY kind")}
    layouts = {layout: n for layout, n in db.execute("SELECT layout, count(*) FROM segments GROUP BY layout")}
    report = {
        "db": str(path),
        "models": db["models"].count,
        "segments": db["segments"].count,
        "layouts": {k[:16]: v for k, v in layouts.items()},
        "by_kind": {k: {**v, "ratio": (v["raw_bytes"] / v["stored_bytes"]) if v["stored_bytes"] else None}
                    for k, v in by_kind.items()},
        "gc_removed": removed,
        "conversations": _listing(Conversations(db)),
    }
    bad = []
    if verify:
        for key, layout in db.execute("SELECT key, layout FROM segments ORDER BY idx").fetchall():
            tier.layout = layout  # verify each row against the layout it claims
            pieces, why = tier.load(bytes.fromhex(key))
            if pieces is None:
                bad.append({"segment": key, "reason": why})
        integrity = db.execute("PRAGMA integrity_check").fetchone()[0]
        report["verify"] = {"checked": report["segments"], "bad": bad, "integrity_check": integrity}
        if integrity != "ok":
            bad.append({"segment": None, "reason": f"integrity_check: {integrity}"})
    tier.close()
    if as_json:
        out.write(json.dumps(report) + "\n")
        return bool(bad)
    out.write(f"{report['db']}\n  models: {report['models']}  segments: {report['segments']}  "
              f"layouts: {len(layouts)}\n")
    out.write(f"  {'state kind':16} {'blobs':>7} {'stored MiB':>11} {'raw MiB':>9} {'ratio':>6}\n")
    for kind, v in report["by_kind"].items():
        ratio = f"{v['ratio']:.2f}" if v["ratio"] else "-"
        out.write(f"  {kind:16} {v['blobs']:7d} {v['stored_bytes'] / 2**20:11.3f} {v['raw_bytes'] / 2**20:9.3f} "
                  f"{ratio:>6}\n")
    if gc:
        out.write(f"  gc: removed {removed} unreachable segment(s)\n")
    if verify:
        out.write(f"  verify: {len(bad)} bad of {report['segments']} segments; integrity_check "
                  f"{report['verify']['integrity_check']}\n")
        for b in bad:
            out.write(f"    {b['segment']}: {b['reason']}\n")
    out.write(f"  conversations: {len(report['conversations'])}\n")
    for c in report["conversations"]:
        out.write(f"    {c['id']}  {_title(c['title'])}  {c['messages']} messages  {c['threads']} threads  "
                  f"updated {c['updated'][:19]}\n")
    return bool(bad)


def _listing(convs: Conversations) -> list[dict]:
    listing = []
    for c in convs.conversations():
        n_messages, n_threads = convs.counts(c.id)
        listing.append({"id": c.id, "title": c.title, "messages": n_messages, "threads": n_threads,
                        "updated": c.updated})
    return listing


def _session(path: Path, session: str, as_json: bool, out: TextIO) -> None:
    db = open_db(path)
    try:
        convs = Conversations(db)
        try:
            conv = convs.conversation(convs.resolve("conversation", session))
        except KeyError as e:
            raise ValueError(e.args[0]) from None
        threads = [(t, len(convs.path(t.id))) for t in convs.threads(conv.id)]
        rows = list(_tree_rows(convs.tree(conv.id)))
    finally:
        db.close()
    if as_json:
        out.write(json.dumps({
            "db": str(path), "conversation": asdict(conv),
            "threads": [{**asdict(t), "messages": n} for t, n in threads],
            # flat, parents first: a long chat nests deeper than a JSON encoder recurses
            "messages": [{**asdict(node["message"]), "depth": depth, "tip_of": node["threads"]}
                         for depth, _, node in rows],
        }) + "\n")
        return
    out.write(f"conversation {conv.id}  {_title(conv.title)}  model {(conv.model or '-')[:16]}  "
              f"updated {conv.updated[:19]}\n  threads:\n")
    for t, n in threads:
        fork = f"  forked from {t.forked_from[:8]}" if t.forked_from else ""
        out.write(f"    {t.id}  {t.name:12} tip {(t.tip or '-')[:8]:8}  {n} messages{fork}\n")
    out.write("  tree:\n")
    for _, lead, node in rows:
        m = node["message"]
        text = " ".join(m.content.split())
        text = text if len(text) <= 60 else text[:59] + "…"
        tokens = f"{m.tokens} tok" if m.tokens is not None else "- tok"
        tips = f"  <- {', '.join(node['threads'])}" if node["threads"] else ""
        out.write(f"    {lead}{m.id[:8]} {m.role:9} {json.dumps(text, ensure_ascii=False)}  {tokens}{tips}\n")


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


def _title(title: str | None) -> str:
    return json.dumps(title, ensure_ascii=False) if title else "(untitled)"


def _gc(db) -> int:
    """Remove segments no chain from a first segment reaches (their parent is gone), repeatedly."""
    removed = 0
    while True:
        orphans = [k for (k,) in db.execute(
            "SELECT s.key FROM segments s WHERE s.idx > 0 AND NOT EXISTS "
            "(SELECT 1 FROM segments p WHERE p.key = s.parent)").fetchall()]
        if not orphans:
            return removed
        with db.conn:
            for key in orphans:
                db.execute("DELETE FROM blobs WHERE segment = ?", [key])
                db.execute("DELETE FROM segments WHERE key = ?", [key])
        removed += len(orphans)

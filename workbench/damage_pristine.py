"""The pristine workbench file every damage case starts from (`make_pristine`): made by a real
chat, checked against the oracle, and described in pristine.json for the workers."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

from workbench.damage_oracle import Oracle, chat_options, read_history
from workbench.damage_spec import QUESTION


def make_pristine(root: Path, model=None) -> Path:
    """Write the model, the workbench file and pristine.json (what workers read) under `root`."""
    from engine import load_model
    from engine.model.random_init import hcw_hybrid_dict, write_random_model
    from workbench.session import ChatSession

    root.mkdir(parents=True, exist_ok=True)
    folder = root / "model"
    if not (folder / "config.json").exists():
        write_random_model(folder, hcw_hybrid_dict(hidden=64), seed=3)
    model = model if model is not None else load_model(folder)
    db = root / "pristine.db"
    for p in (db, *sidecars(db)):
        p.unlink(missing_ok=True)
    s = ChatSession(chat_options(folder, db), model=model)
    s.send("Hello, my name is Ada and I keep bees.")
    s.send("What is two plus two?")
    s.fork(name="aside")
    s.send("Tell me about the bees.")
    s.switch("main")
    s.edit(3, "What is three plus three?")
    s.regenerate()
    s.switch("main")
    s.send("Which flowers do they like?")  # main is the most recently updated: what a resume opens
    conv = s.conversation.id
    s.tier.register_model(bytes.fromhex(s.tier.layout), {"block_size": 16})
    s.tier.register_model(bytes(16), {"block_size": 64, "note": "another layout"})
    s.close()
    other = ChatSession(chat_options(folder, db), model=model)
    other.send("A different chat about rivers.")
    other_conv = other.conversation.id
    other.close()
    if any(p.exists() for p in sidecars(db)):
        raise RuntimeError(f"closing the sessions left a WAL beside {db}")
    con = sqlite3.connect(db)
    threads = [tid for (tid,) in con.execute("SELECT id FROM threads ORDER BY rowid")]
    con.close()
    info = {"db": str(db), "model": str(folder), "conversation": conv, "other": other_conv, "threads": threads,
            "question": QUESTION, "pages": _pages(db), "page_size": _page_size(db), "oracle": []}
    (root / "pristine.json").write_text(json.dumps(info))
    oracle = Oracle(info, model)
    # the oracle is what a reuse="off" session and a cached one both answer on the pristine file
    for reuse in ("off", "exact"):
        scratch = root / f"check-{reuse}.db"
        shutil.copy(db, scratch)
        s = ChatSession(chat_options(folder, scratch, session=conv, reuse=reuse), model=model)
        expected = oracle.answer(read_history(scratch, s.thread.id, strict=True))
        got = s.send(QUESTION).text
        s.close()
        if got != expected:
            raise RuntimeError(f"reuse={reuse} answers {got!r}, the cold engine {expected!r}: no oracle")
        for p in (scratch, *sidecars(scratch)):
            p.unlink(missing_ok=True)
    for tid in threads:
        oracle.answer(read_history(db, tid, strict=True))
    info["oracle"] = [[list(map(list, h)), a] for h, a in oracle.memo.items()]
    (root / "pristine.json").write_text(json.dumps(info))
    return root / "pristine.json"


def sidecars(db: Path) -> list[Path]:
    return [db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]


def _page_size(db: Path) -> int:
    con = sqlite3.connect(db)
    try:
        return con.execute("PRAGMA page_size").fetchone()[0]
    finally:
        con.close()


def _pages(db: Path) -> dict[str, str]:
    """page number -> the table it belongs to (an index's page: its table's), from dbstat."""
    con = sqlite3.connect(db)
    try:
        owner = {name: table for name, table in con.execute("SELECT name, tbl_name FROM sqlite_master")}
        return {str(page): owner.get(name, name) for name, page in con.execute("SELECT name, pageno FROM dbstat")}
    except sqlite3.Error:  # a build without dbstat: the file kinds name no table
        return {}
    finally:
        con.close()

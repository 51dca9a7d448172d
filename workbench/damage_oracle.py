"""The oracle of the damage engine: a cold engine's answer to the next question on a history
(`Oracle`), and the history a thread has in a damaged file as a strict or a lenient reader sees it
(`read_history`), read on a connection of its own and never through the code under test."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path


def chat_options(folder: Path, db: Path, **kw):
    """The options of every session the engine opens (the pristine chat, the oracle's, each case's):
    small blocks and a checkpoint at every segment, so that a few turns fill several segments."""
    from workbench.session import ChatOptions

    return ChatOptions.of(model=folder, db=db, block_size=16, checkpoint_every=1, max_new_tokens=6, **kw)


class Oracle:
    """Cold answers to the question on a history, memoized: a fresh Engine per answer, the
    session's template and sampling."""

    def __init__(self, info: dict, model):
        from workbench.session import ChatSession

        self.question = info["question"]
        self.model = model
        scratch = Path(info["db"]).with_name(f"oracle-{os.getpid()}.db")
        self.session = ChatSession(chat_options(Path(info["model"]), scratch, reuse="off"), model=model)
        self.session.tier.close()  # only its template, tokenizer and sampling are used
        self.memo: dict[tuple, str] = {tuple(map(tuple, h)): a for h, a in info.get("oracle", [])}

    def answer(self, history: list[tuple[str, str]]) -> str:
        from engine.engine import Engine
        from store.conversations import Message

        key = tuple(history)
        if key not in self.memo:
            msgs = [Message("-", "-", None, role, content, None, "") for role, content in history]
            msgs.append(Message("-", "-", None, "user", self.question, None, ""))
            s = self.session
            gen = Engine(self.model).generate(s.prompt_ids(msgs), s.sampling())
            self.memo[key] = s.tok.decode([t for t in gen.token_ids if t not in s.tok.eos_ids])
        return self.memo[key]


def read_history(db: Path, thread_id, strict: bool) -> list[tuple[str, str]] | None:
    """The thread's history as (role, content), root first, read on a connection of its own; None
    when it is not whole (a row missing, of another conversation, not a message, a cycle; with
    `strict`, an id that is not the digest of its row)."""
    from store.conversations import ROLES, message_digest

    try:
        con = sqlite3.connect(db)
    except sqlite3.Error:
        return None
    try:
        row = con.execute("SELECT conversation, tip FROM threads WHERE id = ?", [thread_id]).fetchone()
        if row is None:
            return None
        conv, at = row
        bound = con.execute("SELECT count(*) FROM messages").fetchone()[0]
        out, seen = [], set()
        while at is not None:
            if at in seen or len(out) > bound:
                return None
            seen.add(at)
            m = con.execute("SELECT conversation, parent, role, content FROM messages WHERE id = ?", [at]).fetchone()
            if m is None or m[0] != conv or m[2] not in ROLES or not isinstance(m[3], str) \
                    or not isinstance(m[1], str | None):
                return None
            if strict and at != message_digest(conv, m[1], m[2], m[3]):
                return None
            out.append((m[2], m[3]))
            at = m[1]
        return out[::-1]
    except sqlite3.Error:
        return None
    finally:
        con.close()

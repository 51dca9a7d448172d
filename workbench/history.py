"""`hcw conversations` and `hcw export`: the stored conversations listed (newest first, searched)
and one branch of one written out as Markdown or JSON.

Both read an existing workbench file (`inspect_cmd.existing`: a missing file is no conversations
for the listing, an error for an export; a file that is not a workbench database is refused before
anything opens it)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

from store.conversations import Conversations, Thread, model_label, shorten
from workbench.inspect_cmd import default_db, existing, reading

FORMATS = ("md", "json")


def list_conversations(db_path: Path | None, limit: int, query: str | None, as_json: bool, out: TextIO) -> None:
    if query is not None and not query.strip():
        raise ValueError("-q/--query: an empty query")
    path = Path(db_path or default_db())
    if not path.is_file():
        found: list[dict] = []
    else:
        with reading(existing(path)) as db:
            found = Conversations(db).recent(limit, query)
    if as_json:
        out.write(json.dumps({"db": str(path), "conversations": found}) + "\n")
        return
    if not found:
        out.write(f"no conversations{' matching ' + json.dumps(query) if query else ''} in {path}\n")
        return
    model = max(5, *(len(c["model"] or "-") for c in found))
    out.write(f"{'id':12}  {'updated':16}  {'model':{model}}  {'branches':>8}  {'messages':>8}  title\n")
    for c in found:
        updated = str(c["updated"] or "-")[:16].replace("T", " ")
        out.write(f"{c['id']:12}  {updated:16}  {c['model'] or '-':{model}}  {c['branches']:8d}  "
                  f"{c['messages']:8d}  {c['title'] or '(empty)'}\n")


def export(db_path: Path | None, conversation: str, branch: str | None, fmt: str, out: TextIO) -> None:
    """Write one branch's messages, root first. KeyError: no such conversation or branch;
    ValueError: an ambiguous prefix, an unknown format; ConversationDamaged (a ValueError): the
    branch's history cannot be read whole."""
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    with reading(existing(db_path)) as db:
        convs = Conversations(db)
        conv = convs.conversation(convs.resolve("conversation", conversation))
        thread = _branch(convs.threads(conv.id), branch, conv.id)
        messages = convs.path(thread.id)
    first = next((m.content for m in messages if m.role == "user"), None)
    title = conv.title if isinstance(conv.title, str) and conv.title else shorten(first) if first else None
    model = model_label(conv.model_name, conv.model)
    if fmt == "json":
        out.write(json.dumps({"id": conv.id, "title": title, "model": model, "branch": thread.name,
                              "updated": conv.updated,
                              "messages": [{k: v for k, v in asdict(m).items() if k != "conversation"}
                                           for m in messages]}, ensure_ascii=False, default=str) + "\n")
        return
    out.write(f"# {title or 'Conversation ' + conv.id}\n\n")
    out.write(f"- conversation: {conv.id}\n- branch: {thread.name}\n- model: {model or '-'}\n"
              f"- updated: {conv.updated}\n")
    for m in messages:
        incomplete = " (incomplete)" if m.meta.get("incomplete") is True else ""
        out.write(f"\n## {m.role}{incomplete}\n\n{m.content}\n")


def _branch(threads: list[Thread], name: str | None, conversation: str) -> Thread:
    """The thread named `name` (or whose id starts with it); without a name the most recently
    updated one, the branch `hcw chat --session` continues."""
    usable = [t for t in threads if isinstance(t.id, str)]
    if name is None:
        if not usable:
            raise KeyError(f"conversation {conversation} has no usable branch; `hcw inspect --verify` names the damage")
        return max(usable, key=lambda t: t.updated if isinstance(t.updated, str) else "")
    named = [t for t in usable if t.name == name] or [t for t in usable if t.id.startswith(name)]
    if len(named) != 1:
        known = ", ".join(str(t.name) for t in usable)
        raise KeyError(f"{'no' if not named else 'more than one'} branch {name!r} in conversation {conversation}; "
                       f"branches: {known}")
    return named[0]

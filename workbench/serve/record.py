"""A chat request's optional `conversation` field: the exchange is recorded in the workbench file, as
`hcw chat` records a turn, so that `hcw chat --session ID` (or the next request naming it) continues
it.

    "conversation": "new"   a new conversation: the request's messages, then the answer
    "conversation": ID      (or a unique prefix) its latest branch must be where the request's
                            messages begin: the messages past it, then the answer, go on that
                            branch; messages that part from it start a new branch where they part

Requests stay stateless as in OpenAI's API: the prompt is always the request's own messages.
The conversation is checked before the answer is generated (an unknown id is a 404, messages
sharing nothing with it a 409) and written once the answer is complete; a failed request writes
nothing.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from store.conversations import Conversations, Thread
from store.conversation_types import ConversationDamaged
from workbench.serve.protocol import ApiError


@dataclass
class Target:
    """Where a request's exchange goes: an existing branch and how much of the request it already
    holds (`kept` messages), or a new conversation (thread None)."""

    thread: Thread | None
    kept: int
    fork_at: str | None = None  # a message of the branch to start a new branch from
    tip: str | None = None  # the branch's tip when it was checked
    last_kept: str | None = None  # the branch's message the request's kept messages end with


def find(store: Conversations, conversation: str, messages: list[dict]) -> Target:
    if conversation == "new":
        return Target(None, 0)
    try:
        found = store.conversation(store.resolve("conversation", conversation))
    except KeyError:
        raise ApiError(404, f"no conversation {conversation!r} in the workbench file", code="conversation_not_found",
                       param="conversation") from None
    except ValueError as e:
        raise ApiError(400, str(e), param="conversation") from None
    threads = store.latest_threads(found.id)
    if not threads:
        raise ApiError(409, f"conversation {found.id} has no usable branch", code="conversation_damaged",
                       param="conversation")
    try:
        path = store.path(threads[0].id)
    except ConversationDamaged as e:
        raise ApiError(409, f"conversation {found.id} is damaged: {e}", code="conversation_damaged",
                       param="conversation") from None
    common = 0
    while common < min(len(path), len(messages)) and \
            (path[common].role, path[common].content) == (messages[common]["role"], messages[common]["content"]):
        common += 1
    last = path[common - 1].id if common else None
    if common == len(path):
        return Target(threads[0], common, tip=threads[0].tip, last_kept=last)
    if common == 0:
        raise ApiError(409, f"the messages share nothing with conversation {found.id}'s branch "
                            f"{threads[0].name!r}: send its history first, or \"conversation\": \"new\"",
                       code="conversation_diverged", param="conversation")
    return Target(threads[0], common, fork_at=last, tip=threads[0].tip, last_kept=last)


def write(store: Conversations, target: Target, messages: list[dict], answer: str, answer_tokens: int,
          meta: dict, model: str, layout: str, count) -> dict:
    """The request's messages past `target.kept` and the answer, on the target's branch (a new one
    if it parts); -> the conversation, branch and message ids the response reports."""
    try:
        rest = messages[target.kept:]
        if target.thread is None:
            system = rest[0]["content"] if rest and rest[0]["role"] == "system" else None
            conv, thread = store.create(model=layout, system=system, model_name=model)
            rest = rest[1:] if system is not None else rest
        else:
            fork_at = target.fork_at
            if fork_at is None and store.thread(target.thread.id).tip != target.tip:
                # the branch moved on since the check (another request on it, or hcw chat): this
                # exchange parts from it where the request's messages end
                fork_at = target.last_kept
            thread = store.fork(fork_at) if fork_at else target.thread
        for m in rest:
            store.append(thread.id, m["role"], m["content"], tokens=count(m["content"]))
        message = store.append(thread.id, "assistant", answer, tokens=answer_tokens, meta=meta)
        thread = store.thread(thread.id)
    except (sqlite3.Error, KeyError, ValueError) as e:
        raise ApiError(500, f"the answer could not be recorded in the workbench file: {e}",
                       kind="server_error") from None
    return {"id": thread.conversation, "branch": thread.name, "message": message.id}

"""The values of the conversation tables: Conversation, Thread, Message, the message digest that is
a message's id, and ConversationDamaged, what a read raises when the rows cannot give a history."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant")


class ConversationDamaged(ValueError):
    """A conversation's rows cannot give a whole history. The message is one line naming the
    conversation, the thread, the damaged message or field and what is intact."""

    def __init__(self, finding: str, conversation: str | None = None, at: str | None = None, hint: str = ""):
        super().__init__(f"{finding}; {hint}" if hint else finding)
        self.finding = finding  # the line without the hint, as `check` lists it
        self.conversation = conversation
        self.at = at  # the damaged message, or the id that is missing


@dataclass(frozen=True)
class Conversation:
    id: str
    title: str | None
    model: str | None  # the model's fingerprint, hex
    created: str
    updated: str
    model_name: str | None = None  # what the model was called (a built-in's name, a folder's)


@dataclass(frozen=True)
class Thread:
    id: str
    conversation: str
    name: str
    tip: str | None  # None while the thread is empty
    forked_from: str | None
    created: str
    updated: str


@dataclass(frozen=True)
class Message:
    id: str
    conversation: str
    parent: str | None
    role: str
    content: str
    tokens: int | None
    created: str
    meta: dict = field(default_factory=dict, hash=False)

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise TypeError(f"content must be text, got {type(self.content).__name__}")
        if self.tokens is not None and (not isinstance(self.tokens, int) or self.tokens < 0):
            raise ValueError(f"tokens must be a count, got {self.tokens!r}")


def message_digest(conversation: str, parent: str | None, role: str, content: str) -> str:
    key = json.dumps([conversation, parent or "", role, content]).encode()
    return hashlib.blake2b(key, digest_size=16).hexdigest()

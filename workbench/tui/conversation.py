"""The conversation pane: one Markdown block per message, the answer streamed into the last one."""

from __future__ import annotations

import functools

from markdown_it import MarkdownIt
from textual.containers import VerticalScroll
from textual.widgets import Markdown

from store.conversations import Message


@functools.cache
def _parser() -> MarkdownIt:
    """One parser for every message (Textual's default, "gfm-like"): without a factory, Markdown
    builds a new one on every streamed append, ~3% of the UI thread's time while an answer streams."""
    return MarkdownIt("gfm-like")


class MessageView(Markdown):
    """One message; its role is a CSS class (user / assistant / system)."""

    def __init__(self, markdown: str, classes: str):
        super().__init__(markdown, classes=classes, parser_factory=_parser)


class ConversationView(VerticalScroll):
    def show(self, messages: list[Message]) -> None:
        self.remove_children()
        for i, m in enumerate(messages):
            self.mount(self._view(i, m.role, m.content))
        self.scroll_end(animate=False)

    def add(self, index: int, role: str, text: str) -> MessageView:
        view = self._view(index, role, text)
        self.mount(view)
        self.scroll_end(animate=False)
        return view

    @staticmethod
    def _view(index: int, role: str, text: str) -> MessageView:
        view = MessageView(text, classes=role)
        view.border_title = f"{index} · {role}"
        return view

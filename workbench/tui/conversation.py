"""The conversation pane: one Markdown block per message, the answer streamed into the last one."""

from __future__ import annotations

from textual.containers import VerticalScroll
from textual.widgets import Markdown

from store.conversations import Message


class MessageView(Markdown):
    """One message; its role is a CSS class (user / assistant / system)."""


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

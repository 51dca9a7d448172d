"""The conversation pane: one Markdown block per message, the answer streamed into the last one."""

from __future__ import annotations

import functools

from markdown_it import MarkdownIt
from textual.await_complete import AwaitComplete
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

    def __init__(self, markdown: str, role: str, streamed: bool = False):
        super().__init__(markdown, classes=role, parser_factory=_parser)
        self.role = role
        # built by appends as an answer streamed in: Markdown.append re-parses from the last block
        # it drew, which gives the document a whole parse gives, unless an append starts before the
        # one before it has parsed (then it re-parses text already drawn: a block twice). Only a view
        # whose appends overlapped is re-drawn from the stored message once the turn is over.
        self.streamed = streamed
        self.overlapped = False
        self._appending: AwaitComplete | None = None
        self._height = 0

    def append(self, markdown: str) -> AwaitComplete:
        if self._appending is not None and not self._appending.is_done:
            self.overlapped = True
        self._appending = super().append(markdown)
        return self._appending

    def on_resize(self, event) -> None:
        """The last message grew (an answer streaming in, or laid out after the pane scrolled): a
        pane that was at its end follows it; one the user has scrolled up stays where it is."""
        grown, self._height = event.size.height - self._height, event.size.height
        pane = self.parent
        if grown > 0 and isinstance(pane, ConversationView) and pane.children[-1] is self \
                and pane.scroll_y >= pane.max_scroll_y - grown - 1:
            pane.scroll_end(animate=False, immediate=True)


class ConversationView(VerticalScroll):
    def show(self, messages: list[Message]) -> None:
        """Display `messages`, keeping the views of the leading ones already shown as they are
        (after a turn, everything but the new messages; after a branch switch, everything up to the
        fork): remounting every message re-parses and re-lays out all of them, ~15 ms each, which in
        a long conversation froze the screen for a second after every answer. A streamed answer is
        kept as drawn when it holds the stored text (re-drawing it was most of a turn's end)."""
        views = list(self.query_children(MessageView))
        keep = 0
        for view, m in zip(views, messages):
            if view.role != m.role or not (view.streamed or view.source == m.content):
                break
            if view.streamed:
                if view.overlapped or view.source != m.content:
                    view.update(m.content)
                view.streamed = view.overlapped = False
                view.border_title = _title(keep, m.role, m.meta)
            keep += 1
        for view in views[keep:]:
            view.remove()
        if keep < len(messages):
            self.mount_all([self._view(i, m.role, m.content, meta=m.meta) for i, m in enumerate(messages) if i >= keep])
        # to the end when messages changed (a switch, an edit, a new turn shown); after a turn whose
        # answer is already on screen, only if the pane was following it, not while the user reads
        if keep < len(views) or keep < len(messages) or self.scroll_y >= self.max_scroll_y - 1:
            self.scroll_end(animate=False)

    def add(self, index: int, role: str, text: str, streamed: bool = False) -> MessageView:
        view = self._view(index, role, text, streamed)
        self.mount(view)
        self.scroll_end(animate=False)
        return view

    @staticmethod
    def _view(index: int, role: str, text: str, streamed: bool = False, meta: dict | None = None) -> MessageView:
        view = MessageView(text, role, streamed)
        view.border_title = _title(index, role, meta or {})
        return view


def _title(index: int, role: str, meta: dict) -> str:
    """'3 · assistant', labelled when the answer is not whole: the process was killed in the middle
    of it (what had streamed is kept), or Esc cancelled it."""
    return f"{index} · {role}" + (" · incomplete (interrupted)" if meta.get("incomplete") else
                                  " · cancelled" if meta.get("stop_reason") == "cancelled" else "")

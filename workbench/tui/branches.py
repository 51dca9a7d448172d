"""The branch tree: the conversation's messages as a tree. A run of messages without a fork is
one level (a long conversation stays readable in a narrow pane); at a fork, each branch's first
message is nested under the message they leave from, and the rest of that branch under it. Every label starts with the message's number (what /fork N
and /edit N take); each branch's tip is marked, the current branch's tip is highlighted and the
cursor follows it. Selecting a tip switches to that branch (a BranchChosen message up)."""

from __future__ import annotations

from rich.text import Text
from textual import on
from textual.widgets import Tree

from store.conversations import Conversations, Thread
from workbench.tui.messages import BranchChosen
from workbench.tui.steady import SteadyScrollbars

TEXT = 40  # characters of a message in its label


class BranchTree(SteadyScrollbars, Tree):
    def __init__(self, **kw):
        super().__init__("conversation", **kw)
        self.show_root = False
        self.guide_depth = 2
        self.tip = None  # the node of the current branch's tip

    def show(self, store: Conversations, conversation: str, current: Thread) -> None:
        self.clear()
        self.tip = None
        tips: dict[str, list[Thread]] = {}
        for t in store.threads(conversation):
            if t.tip:
                tips.setdefault(t.tip, []).append(t)
        # (the node to add it under, the message's tree item, its number, whether it starts a branch)
        stack = [(self.root, node, 0, False) for node in reversed(store.tree(conversation))]
        while stack:
            parent, item, index, head = stack.pop()
            m = item["message"]
            here = tips.get(m.id, [])
            text = m.content.replace("\n", " ")
            current_tip = any(t.id == current.id for t in here)
            label = Text(f"{index} {m.role[0].upper()} {text[:TEXT]}{'…' if len(text) > TEXT else ''}",
                         style="bold reverse" if current_tip else "")
            for t in here:
                label.append(f" ◀ {t.name}", style="bold" if t.id == current.id else "")
            children = item["children"]
            forks = len(children) > 1
            node = parent.add(label, data=here[0].id if here else None, expand=True,
                              allow_expand=forks or (head and bool(children)))
            if current_tip:
                self.tip = node
            if forks:  # each branch nested under the message it leaves from
                stack.extend((node, child, index + 1, True) for child in reversed(children))
            elif children:  # the run goes on: under its branch's first message, or at this level
                stack.append((node if head else parent, children[0], index + 1, False))
        if self.tip is not None:
            self.call_after_refresh(self._follow)

    def _follow(self) -> None:
        """The cursor to the tip, and the tip on the pane's last line (or the tree from its top when
        it fits): the same view whatever was scrolled before, not just enough to show the tip."""
        if self.tip is not None and self.tip.tree is self:
            self.move_cursor(self.tip, animate=False)
            line = self.tip.line
            if line >= 0:
                self.scroll_to(y=max(0, line - self.scrollable_content_region.height + 1), animate=False)
                # the scrollbar's thumb too: it could stay where it was, under a view scrolled elsewhere
                self.vertical_scrollbar.position = self.scroll_offset.y

    @on(Tree.NodeSelected)
    def _chosen(self, event: Tree.NodeSelected) -> None:
        event.stop()
        if event.node.data:
            self.post_message(BranchChosen(event.node.data))

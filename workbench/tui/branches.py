"""The branch tree: the conversation's messages as a tree; each branch's tip is marked and the
current branch is highlighted. Selecting a tip switches to that branch."""

from __future__ import annotations

from textual.widgets import Tree

from store.conversations import Conversations, Thread
from workbench.tui.steady import SteadyScrollbars


class BranchTree(SteadyScrollbars, Tree):
    def __init__(self, **kw):
        super().__init__("conversation", **kw)
        self.show_root = False
        self.guide_depth = 2

    def show(self, store: Conversations, conversation: str, current: Thread) -> None:
        self.clear()
        tips: dict[str, list[Thread]] = {}
        for t in store.threads(conversation):
            if t.tip:
                tips.setdefault(t.tip, []).append(t)
        stack = [(self.root, node) for node in reversed(store.tree(conversation))]
        while stack:
            parent, item = stack.pop()
            m = item["message"]
            here = tips.get(m.id, [])
            marks = "".join(f" ◀ {t.name}" for t in here)
            text = m.content.replace("\n", " ")
            label = f"{m.role[0].upper()} {text[:40]}{'…' if len(text) > 40 else ''}{marks}"
            node = parent.add(label, data=here[0].id if here else None, expand=True,
                              allow_expand=bool(item["children"]))
            if any(t.id == current.id for t in here):
                node.set_label(f"[b reverse]{label}[/]")
            stack.extend((node, child) for child in reversed(item["children"]))

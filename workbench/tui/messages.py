"""The app's messages: what its worker and its widgets tell the app ("attributes down, messages
up": the app sets what its widgets show; they, and the generating thread, post a message when
something happened). `post_message` is thread-safe, so the worker posts these directly."""

from __future__ import annotations

from textual.message import Message

from workbench.turns import TurnResult


class TurnDone(Message):
    """The worker's turn ended with an answer (complete or cancelled)."""

    def __init__(self, result: TurnResult) -> None:
        super().__init__()
        self.result = result


class TurnFailed(Message):
    """The worker's turn raised: the session is unchanged past its last saved turn."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error


class BranchChosen(Message):
    """The user picked a branch's tip in the branch tree."""

    def __init__(self, thread: str) -> None:
        super().__init__()
        self.thread = thread


class CommandChosen(Message):
    """A command picked in the palette: run it, or (it needs arguments) put it in the prompt."""

    def __init__(self, text: str, run: bool = True) -> None:
        super().__init__()
        self.text = text
        self.run = run

"""End to end on a real terminal: `hcw chat` in a detached 80x24 tmux session, driven by keys, its
screen read back with `tmux capture-pane`. `/help` must be readable in full there: every command of
the table on the screen (scrolling the panel when it is taller than the terminal). Skipped only
where tmux is not installed. Every wait polls the screen, with a deadline, never a fixed sleep."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.model.random_init import hcw_hybrid_dict, write_random_model
from workbench.commands import COMMANDS

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")

START_S = 180.0  # the app's start, the engine's process loading the model included, on a loaded machine
STEP_S = 30.0


class Terminal:
    """One tmux server of its own (a private socket) holding one 80x24 session."""

    def __init__(self, tmp: Path, command: list[str], env: dict[str, str], size=(80, 24)):
        self.socket = f"hcw-e2e-{os.getpid()}-{time.monotonic_ns()}"
        conf = tmp / "tmux.conf"
        conf.write_text("set -g status off\nset -g remain-on-exit on\nset -sg escape-time 0\n")
        self._tmux("-f", str(conf), "new-session", "-d", "-s", "e2e", "-x", str(size[0]), "-y", str(size[1]),
                   *(a for k, v in env.items() for a in ("-e", f"{k}={v}")), " ".join(map(_quote, command)))

    def _tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], check=True, capture_output=True, text=True,
                              timeout=30).stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "e2e")

    def keys(self, *keys: str, literal: bool = False) -> None:
        self._tmux("send-keys", "-t", "e2e", *(["-l"] if literal else []), *keys)

    def until(self, condition, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if condition(screen):
                return screen
            if self.dead():
                raise AssertionError(f"{what}: the app ended first; its last screen:\n{screen}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not on the screen within {timeout:.0f} s; the screen:\n{screen}")
            time.sleep(0.1)

    def dead(self) -> bool:
        return self._tmux("display-message", "-p", "-t", "e2e", "#{pane_dead}").strip() == "1"

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


def _quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\\''") + "'"


def test_help_reads_in_full_on_an_80x24_terminal(tmp_path):
    model = write_random_model(tmp_path / "model", hcw_hybrid_dict(hidden=64), seed=3)
    hcw = Path(sys.executable).with_name("hcw")
    command = [str(hcw), "chat", "--model", str(model), "--db", str(tmp_path / "c.db")]
    env = {"HCW_HOME": str(tmp_path / "home"), "TERM": "xterm-256color", "COLUMNS": "80", "LINES": "24"}
    term = Terminal(tmp_path, command, env)
    try:
        term.until(lambda s: "/help for commands" in s, START_S, "the prompt")
        term.keys("/help", literal=True)
        term.keys("Enter")
        seen = term.until(lambda s: "commands:" in s and "↑↓" in s, STEP_S, "the /help panel")
        lines = set(seen.splitlines())
        for _ in range(10):  # scroll the panel to its end, collecting what each screen shows
            if all(any(f"/{c.name}" in line for line in lines) for c in COMMANDS):
                break
            before = seen
            term.keys("PageDown")
            try:
                seen = term.until(lambda s: s != before, 5.0, "the panel scrolled")
            except AssertionError:  # nothing moved: the panel is at its end
                break
            lines |= set(seen.splitlines())
        missing = [c.usage for c in COMMANDS if not any(f"  {c.usage}" in line for line in lines)]
        assert not missing, f"not on the screen: {missing}\n{seen}"
        assert all(len(line) <= 80 for line in seen.splitlines())
        term.keys("Escape")
        term.until(lambda s: "commands:" not in s, STEP_S, "the conversation again (Esc closed the panel)")
        term.keys("C-q")
        deadline = time.monotonic() + STEP_S
        while not term.dead():  # the app exits (remain-on-exit keeps the pane to read)
            assert time.monotonic() < deadline, f"the app did not quit:\n{term.screen()}"
            time.sleep(0.1)
    finally:
        term.close()

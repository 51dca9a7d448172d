"""The validation panel: the last lookup's logical hit, the four layers' pass/fail with reasons,
the plan (reuse / recover via which path / recompute) and the outcome."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from workbench.plain import describe_plan
from workbench.session import TurnResult

STYLE = {"hit": "bold green", "degraded": "bold yellow", "recomputed": "bold red", "miss": "dim"}


class ValidationPanel(Static):
    def show(self, result: TurnResult | None) -> None:
        text = Text()
        for line in describe_plan(result):
            if line.startswith("outcome:"):
                outcome = line.split()[1]
                text.append(line + "\n", style=STYLE.get(outcome, ""))
            elif line.startswith("layer") and "FAIL" in line:
                text.append(line + "\n", style="red")
            elif line.startswith("layer"):
                text.append(line + "\n", style="green")
            else:
                text.append(line + "\n")
        self.update(text)

"""Replay budget gauges: for each resume, how the prompt was served — reused from the cache,
recovered (recomputed for a missing state), or computed new — and, for a Tail-Replay resume, the
GDN replay against its budget, labelled exact or approximate."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from workbench.turns import TurnResult

WIDTH = 20  # characters of a gauge
TURNS = 5  # resumes shown


def split(result: TurnResult) -> tuple[int, int, int]:
    """(reused, recovered, new) prompt tokens."""
    plan = result.lookup.plan if result.lookup else None
    reused = plan.usable_tokens if plan else 0
    recovered = max(0, (plan.granular_tokens if plan else 0) - reused)
    return reused, recovered, max(0, result.prompt_tokens - reused - recovered)


class ReplayBudget(Static):
    """The last TURNS resumes, one line each, over the legend."""

    def __init__(self, **kw):
        self.turns: list[TurnResult] = []
        super().__init__(self.render_turns(), **kw)  # (update() needs a running app; the first text does not)

    def add(self, result: TurnResult) -> None:
        self.turns = (self.turns + [result])[-TURNS:]
        self.update(self.render_turns())

    def render_turns(self) -> Text:
        text = Text("no turn yet\n" if not self.turns else "")
        for i, r in enumerate(self.turns):
            reused, recovered, new = split(r)
            total = max(1, r.prompt_tokens)
            bar = [int(WIDTH * x / total) for x in (reused, recovered)]
            text.append("█" * bar[0], style="green")
            text.append("█" * bar[1], style="yellow")
            text.append("░" * max(0, WIDTH - sum(bar)), style="grey50")
            text.append(f" {reused}+{recovered}+{new}/{r.prompt_tokens} ")
            text.append("exact" if r.exact else "approximate", style="" if r.exact else "bold magenta")
            if r.replay_tokens:
                budget = f"/{r.replay_budget_tokens}" if r.replay_budget_tokens else ""
                seeded = " from a sketch" if r.lookup.plan.replay_seed is not None else ""
                text.append(f" · replay {r.replay_tokens}{budget}{seeded}")
            text.append("\n")
        text.append("reused", style="green")
        text.append(" + ")
        text.append("recovered", style="yellow")
        text.append(" + new / prompt tokens")
        return text

"""Typed engine events: what the UI, the CLI and the metrics see of each cache decision."""

from __future__ import annotations

from dataclasses import dataclass

from engine.cache.validation import ReusePlan


@dataclass(frozen=True)
class CacheLookup:
    """One prompt's trip through the cache: logical hit -> plan -> outcome."""

    step: int
    plan: ReusePlan
    replan_reason: str = ""  # why an earlier plan for this lookup was abandoned, if one was

    @property
    def outcome(self) -> str:
        if self.plan.usable_tokens == 0:
            return "miss" if self.plan.logical_tokens == 0 else "recomputed"
        return "degraded" if self.plan.degraded else "hit"

    @property
    def reasons(self) -> tuple[str, ...]:
        """What the user is shown: each validation failure as its text, then the re-plan reason."""
        return tuple(str(f) for f in self.plan.failures) + ((self.replan_reason,) if self.replan_reason else ())

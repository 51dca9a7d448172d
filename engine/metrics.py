"""Cache counters: hit rate, degraded-hit rate, usable vs logical hit tokens, failures by layer."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from engine.cache.validation import Action
from engine.events import CacheLookup


@dataclass
class CacheMetrics:
    lookups: int = 0
    hits: int = 0  # lookups that reused anything
    degraded_hits: int = 0  # logical hits that could not be used in full
    prompt_tokens: int = 0
    logical_hit_tokens: int = 0
    usable_hit_tokens: int = 0
    recomputed_tokens: int = 0
    replans: int = 0
    validation_failures: Counter = field(default_factory=Counter)  # by validation layer (a Miss's kind)
    recoveries: Counter = field(default_factory=Counter)  # by state kind
    recovery_ms: dict = field(default_factory=dict)  # state kind -> Histogram of recovery latency
    lower_fetches: int = 0  # segments brought in from the lower (disk) tier, verified
    spills: int = 0  # records evicted from memory to the lower tier
    lower_failures: Counter = field(default_factory=Counter)  # lower-tier misses by kind
    shadow_checks: int = 0
    shadow_mismatches: int = 0
    shadow_max_diff: float = 0.0
    bytes_copied: int = 0  # by assembly into hits' states (a paged layer's mapped blocks: none)

    def record_recovery(self, plan, ms: float) -> None:
        for obj in plan.objects:
            if obj.action == Action.RECOVER:
                self.recovery_ms.setdefault(obj.kind, Histogram()).add(ms)

    def record_shadow(self, max_diff: float, tolerance: float = 1e-4) -> bool:
        """Count one shadow check; True when the hit agreed with the cold prefill."""
        self.shadow_checks += 1
        self.shadow_mismatches += max_diff > tolerance
        self.shadow_max_diff = max(self.shadow_max_diff, max_diff)
        return max_diff <= tolerance

    def record(self, event: CacheLookup) -> None:
        plan = event.plan
        self.lookups += 1
        self.hits += plan.usable_tokens > 0
        self.degraded_hits += plan.degraded and plan.logical_tokens > 0
        self.prompt_tokens += plan.prompt_tokens
        self.logical_hit_tokens += plan.logical_tokens
        self.usable_hit_tokens += plan.usable_tokens
        self.recomputed_tokens += plan.prompt_tokens - plan.usable_tokens
        for failure in plan.failures:
            self.validation_failures[failure.kind] += 1
        for obj in plan.objects:
            if obj.action == Action.RECOVER:
                self.recoveries[obj.kind] += 1

    def as_dict(self) -> dict:
        return {
            "lookups": self.lookups, "hits": self.hits, "degraded_hits": self.degraded_hits,
            "hit_rate": self.hits / self.lookups if self.lookups else 0.0,
            "degraded_hit_rate": self.degraded_hits / self.lookups if self.lookups else 0.0,
            "prompt_tokens": self.prompt_tokens, "logical_hit_tokens": self.logical_hit_tokens,
            "usable_hit_tokens": self.usable_hit_tokens, "recomputed_tokens": self.recomputed_tokens,
            "replans": self.replans, "validation_failures": dict(self.validation_failures),
            "recoveries": dict(self.recoveries),
            "recovery_ms": {k: h.as_dict() for k, h in dict(self.recovery_ms).items()},  # a copy: read from other threads
            "lower": {"fetches": self.lower_fetches, "spills": self.spills, "failures": dict(self.lower_failures)},
            "shadow": {"checks": self.shadow_checks, "mismatches": self.shadow_mismatches,
                       "max_diff": self.shadow_max_diff},
        }


@dataclass
class Histogram:
    """Counts per latency bucket (upper bounds in ms) plus count and sum."""

    bounds: tuple[float, ...] = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000, float("inf"))
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def add(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.bounds)
        self.counts[next(i for i, b in enumerate(self.bounds) if value <= b)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def as_dict(self) -> dict:
        return {"count": self.count, "sum_ms": self.total,
                "buckets": {("inf" if b == float("inf") else str(b)): c for b, c in zip(self.bounds, self.counts)}}

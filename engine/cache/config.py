"""CacheConfig: everything a PrefixCache is told at its making, checked once."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from engine.cache.recovery import GROUPS
from engine.cache.replay import ReplayPolicy


class Reuse(StrEnum):
    """What a cache hit may be: provably exact only, approximate too (Tail-Replay, labelled), or
    no cache at all. A StrEnum: equal to its name as text, as a config file or flag gives it."""

    EXACT = "exact"
    APPROXIMATE = "approximate"
    OFF = "off"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 64
    budget_bytes: int = 1 << 30  # device tier
    host_budget_bytes: int = 0  # host tier: device records are demoted here before they are evicted
    group_budgets: tuple[tuple[str, int], ...] = ()  # per cache group, e.g. (("recurrent", 64 << 20),)
    checkpoint_every: int = 4  # boundary snapshots kept every K segments (plus request ends, branch points)
    checkpoint_request_end: bool = True  # keep the last boundary a request wrote
    checkpoint_branch_point: bool = True  # keep the first boundary a request wrote (where it left the cache)
    checkpoint_tail: int = 3  # and every one of the last K boundaries before the prompt's end (an edit near it) ...
    # ... of a request that computes at least this many prompt tokens: each kept boundary costs its
    # snapshots' copies (taken inside the forward pass, no prefill stop), so only long prompt parts
    # pay for them (docs/BENCHMARKS.md)
    checkpoint_tail_min: int = 4096
    # every K segments an int8 sketch of each GDN state (~1/4 of its bytes) where no exact
    # snapshot is kept: an approximate replay may restart from it instead of zero, its certified
    # error the sketch's own times the decay since (0: none; the exact policy never reads them)
    sketch_every: int = 0
    reuse: str = "exact"  # "exact" | "approximate" (Tail-Replay, labelled) | "off"
    replay_budget: float | None = 0.05  # approximate: tokens a GDN replay may take (fraction of the match if < 1)
    replay_tolerance: float | None = None  # approximate, adaptive: per layer the shortest replay within this bound
    # exact: a GDN replay of a whole match from its start (exact: the state there is zero), over its
    # cached KV, costs about `exact_replay_cost` of recomputing it; when the nearest checkpoint
    # leaves more than that share to recompute, the replay is taken instead (False: checkpoints only)
    exact_replay: bool = True
    exact_replay_cost: float | None = None  # None: the share of layers a replay runs (through the last GDN one)
    max_pending_recoveries: int = 4  # admission cap: reuses in flight that still need recovery
    recovery_budget_tokens: int = 1 << 16  # admission cap: tokens those may recompute, together
    static: bool = False  # static execution: freeze the cache topology, check it on every replay
    lower_deadline_s: float = 1.0  # a lower-tier (disk) read must arrive within this ...
    lower_deadline_per_token_s: float = 1e-4  # ... plus this per prompt token
    shadow_fraction: float = 0.0  # share of hits recomputed cold and compared (shadow verification)
    # states made by a deterministic engine (EngineConfig.deterministic: one token a step): a file
    # of them has its own fingerprint, so batched and bit-exact states never mix
    deterministic: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.checkpoint_every < 1:
            raise ValueError("checkpoint_every must be >= 1")
        if self.sketch_every < 0:
            raise ValueError("sketch_every must be >= 0 (0: no sketches)")
        if self.checkpoint_tail < 0 or self.checkpoint_tail_min < 0:
            raise ValueError("checkpoint_tail and checkpoint_tail_min must be >= 0")
        if not 0.0 <= self.shadow_fraction <= 1.0:
            raise ValueError("shadow_fraction must be in [0, 1]")
        unknown = sorted({g for g, _ in self.group_budgets} - set(GROUPS))
        if unknown:
            raise ValueError(f"unknown cache groups {unknown}; groups: {', '.join(GROUPS)}")
        if self.exact_replay_cost is not None and not 0 < self.exact_replay_cost <= 1:
            raise ValueError("exact_replay_cost must be in (0, 1], or None (from the model)")
        if self.reuse not in tuple(Reuse):
            raise ValueError(f"reuse must be 'exact', 'approximate' or 'off', got {self.reuse!r}")
        self.replay_policy  # checks the budget and tolerance

    @property
    def replay_policy(self) -> ReplayPolicy:
        if self.reuse != Reuse.APPROXIMATE:
            return ReplayPolicy()
        return ReplayPolicy("approximate", self.replay_budget, self.replay_tolerance)

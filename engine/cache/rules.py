"""Consistency rules the cache state machine may never violate (the other two live where they act:
five-state routing in recovery.py, temporal consistency in assembly.py's `Assembler.restore`: pins
for the whole check-to-use window, versions compared before use, a changed version re-plans).

Admission cap: at most `max_pending` reuses whose plans still need recovery may be in flight, and
their recovery work (tokens to recompute) stays within `recovery_budget_tokens`; beyond that a
request does not wait on a pile of "hit but recovering": it is told to recompute from scratch.

Static topology: in static-execution mode (CUDA graphs / compiled static shapes) the cache
topology - layer kinds, each piece's non-token shape and dtype, block size - is frozen at capture;
every replay checks its fingerprint, and a change means re-capture or run eager, never a replay
over a different layout.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from engine.cache.validation import Action, ReusePlan


@dataclass
class AdmissionControl:
    max_pending: int = 4
    recovery_budget_tokens: int = 1 << 16
    pending: dict[int, int] = field(default_factory=dict)  # ticket -> recovery tokens in flight
    refused: int = 0
    _next: int = 0

    def __post_init__(self) -> None:
        if self.max_pending < 1 or self.recovery_budget_tokens < 0:
            raise ValueError("max_pending must be >= 1 and the recovery budget >= 0")

    @staticmethod
    def recovery_tokens(plan: ReusePlan) -> int:
        """Tokens the plan recomputes *because* state was missing (beyond the matched prefix's end),
        and those a replay runs to rebuild GDN states."""
        missing = plan.matched_tokens - plan.usable_tokens if any(o.action == Action.RECOVER for o in plan.objects) else 0
        return missing + plan.replay_tokens

    def admit(self, plan: ReusePlan) -> int | None:
        """A ticket to hold while the plan is carried out, or None: do not reuse, recompute."""
        cost = self.recovery_tokens(plan)
        if cost:
            recovering = [c for c in self.pending.values() if c]
            if len(recovering) >= self.max_pending or sum(recovering) + cost > self.recovery_budget_tokens:
                self.refused += 1
                return None
        self._next += 1
        self.pending[self._next] = cost
        return self._next

    def release(self, ticket: int) -> None:
        self.pending.pop(ticket, None)


def topology_fingerprint(block_size: int, template_pieces: list[dict]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(str(block_size).encode())
    for i, pieces in enumerate(template_pieces):
        for kind, piece in sorted(pieces.items()):
            items = piece.data if isinstance(piece.data, tuple) else (piece.data,)
            shapes = [(tuple(t.shape), str(t.dtype)) if t is not None else None for t in items]
            h.update(f"{i}:{kind}:{piece.per_segment}:{shapes}".encode())
    return h.digest()


@dataclass
class TopologyGuard:
    """Frozen at capture when static execution is on; `check` before every replay."""

    frozen: bytes | None = None
    mismatches: int = 0

    def freeze(self, fingerprint: bytes) -> None:
        self.frozen = fingerprint

    def check(self, fingerprint: bytes) -> bool:
        """True: replay the captured graph. False: the topology changed; re-capture or run eager."""
        if self.frozen is None or self.frozen == fingerprint:
            return True
        self.mismatches += 1
        return False

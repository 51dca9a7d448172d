"""Five-state routing: one recovery path per state kind, dispatched by kind, never a generic
fallback. The validator asks `route(kind)` what to do when a piece a hit needs is missing.

Every path here is exact: it moves the resume point back to where the state exists and
recomputes forward (the approximate path, tail replay, is separate and opt-in).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.cache.states import Kind


@dataclass(frozen=True)
class Route:
    path: str  # what recovery does, as the plan and the events name it
    per_segment: bool  # the piece is a per-segment slice (else a snapshot at a segment end)
    group: str  # the cache group (pool) whose budget the kind's pieces count against


ROUTES: dict[str, Route] = {
    # GDN states are not token-addressable: resume at the nearest earlier checkpoint, replay from there
    Kind.RECURRENT: Route("replay from the nearest earlier checkpoint", False, "recurrent"),
    Kind.CONV: Route("replay from the nearest earlier checkpoint", False, "recurrent"),
    # per-token decay statistics (Tail-Replay's error bound): recompute the segments missing them
    # (only approximate plans need them: exact reuse goes on without; their own group, so a
    # recurrent-state budget never trims them)
    Kind.DECAY: Route("recompute from the first segment missing decay statistics", True, "statistics"),
    # an int8 sketch of a GDN state (approximate plans only: it seeds a tail replay); when missing
    # the replay restarts from zero or the exact plan resumes at a checkpoint
    Kind.SKETCH: Route("replay from zero or from the nearest exact checkpoint", False, "recurrent"),
    # token-addressable KV: recompute the tokens of the first segment whose KV is gone
    Kind.KV: Route("recompute from the first segment missing KV", True, "full_kv"),
    # compressed entries are rebuilt only from the layer's inputs, which are not kept: recompute
    Kind.COMPRESSED: Route("recompute from the first segment missing compressed entries", True, "compressed"),
    # the open window's raw tokens: resume at an earlier boundary and recompute the tail tokens
    Kind.TAIL: Route("recompute the uncompressed tail from an earlier boundary", False, "compressed"),
    Kind.OVERLAP: Route("recompute the overlap window from an earlier boundary", False, "compressed"),
    # the sliding window must be aligned to the resume point: redraw it at an earlier boundary
    Kind.WINDOW: Route("redraw the sliding window at an earlier boundary", False, "swa"),
    # indexer keys come from the compressed inputs, never from KV alone: recompute them
    Kind.INDEX_KEYS: Route("recompute indexer keys from the first segment missing them", True, "indexer"),
    Kind.INDEX_TAIL: Route("recompute the indexer tail from an earlier boundary", False, "indexer"),
    Kind.INDEX_OVERLAP: Route("recompute the indexer overlap from an earlier boundary", False, "indexer"),
    # a segment only the lower tier held: fetched with a deadline; failure, timeout or corruption
    # makes that range a miss, recomputed
    "on_disk": Route("fetch from the lower tier failed or timed out: recompute the range", True, "lower"),
}


GROUPS = sorted({r.group for r in ROUTES.values()})


def group_of(kind: str) -> str:
    return route(kind).group


def route(kind: str) -> Route:
    try:
        return ROUTES[kind]
    except KeyError:
        raise KeyError(f"no recovery route for state kind {kind!r}; every kind needs its own") from None

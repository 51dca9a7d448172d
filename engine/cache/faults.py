"""Fault drills, first-class and public: break one kind of cached state on purpose, then show
that the next hit is still exact, that its plan names the recovery path, and that the event says
so. `run_drills` is what `hcw drill` prints.

Each drill gets a warm cache (one prompt of `prompt_len` tokens recorded) and damages it; the
probe prompt is that prompt plus a few tokens, compared with a cold prefill.
"""

from __future__ import annotations

from collections.abc import Callable
import time
from dataclasses import dataclass, replace

import torch

from engine.cache.config import CacheConfig
from engine.cache.miss import Miss
from engine.cache.prefix_cache import PrefixCache
from engine.cache.state_table import SegmentRecord
from engine.cache.states import Kind
from engine.cache.validation import Action


def _records(cache: PrefixCache, tokens: list[int]) -> list[SegmentRecord]:
    return [view.record for view in cache.segments_of(tokens)]


def _drop(cache, records, kinds: set[str], which: Callable[[int, int], bool]) -> int:
    """Drop `kinds` from records whose position `which(j, n)` selects; returns pieces dropped."""
    before = sum(len(r.pieces) for r in records)
    n = len(records)
    for j, rec in enumerate(records):
        if which(j, n):
            cache.table.drop(rec.key, lambda layer, kind, p: kind in kinds)
    return before - sum(len(r.pieces) for r in records)


def _middle(j: int, n: int) -> bool:
    return j == n // 2


def _last_two(j: int, n: int) -> bool:
    return j >= n - 2


def evict_compressed(cache, records):
    return _drop(cache, records, {Kind.COMPRESSED}, _middle)


def drop_tail(cache, records):
    return _drop(cache, records, {Kind.TAIL, Kind.INDEX_TAIL}, _last_two)


def expire_window(cache, records):
    return _drop(cache, records, {Kind.WINDOW}, _last_two)


def misalign_window(cache, records):
    """The last boundary's window replaced by an earlier boundary's: same shape, wrong place."""
    if len(records) < 2:
        return 0
    last, earlier = records[-1], records[-2]
    moved = [k for k in last.pieces if k[1] == Kind.WINDOW and k in earlier.pieces]
    for key in moved:
        last.pieces[key] = earlier.pieces[key]
    return len(moved)


def invalidate_indexer(cache, records):
    return _drop(cache, records, {Kind.INDEX_KEYS}, _middle)


def drop_gdn_checkpoint(cache, records):
    return _drop(cache, records, {Kind.RECURRENT, Kind.CONV}, _last_two)


def corrupt_dtype(cache, records):
    """A snapshot that would reach compute in the wrong dtype (as if decoded wrongly)."""
    rec = records[-1]
    for key, piece in rec.pieces.items():
        if not piece.per_segment and piece.data is not None:
            first = piece.data[0] if isinstance(piece.data, tuple) else piece.data
            wrong = first.to(torch.float64)
            rec.pieces[key] = replace(piece, data=(wrong, *piece.data[1:]) if isinstance(piece.data, tuple) else wrong)
            return 1
    return 0


def bump_version(cache, records):
    """A concurrent writer changes a record between the check and the use."""
    fired = []

    def bump(plan):
        if not fired and plan.keys:
            fired.append(True)
            cache.table.get(plan.keys[-1]).version += 1
    cache.before_use = bump
    return 1


def change_topology(cache, records):
    """Static execution captured under another cache topology (e.g. other groups or block tables)."""
    cache.guard.freeze(b"captured under another topology")
    return 1


class MemoryTier:
    """A lower tier in memory (the `LowerTier` protocol) whose reads can be made to fail or stall:
    the drills' stand-in for a disk, so they run without one."""

    def __init__(self):
        self.rows: dict[bytes, tuple] = {}
        self.mode = ""  # "" | "fail" | "delay"
        self.delay_s = 0.0

    def save(self, key, parent, index, tokens, layout, pieces) -> tuple[bool, Miss | None]:
        # a save under another layout replaces the row whole, as the disk tier's does
        old = self.rows[key][3] if key in self.rows and self.rows[key][4] == layout else {}
        self.rows[key] = (parent, index, tokens, {**old, **{k: (p, _copy(d), pos) for k, (p, d, pos) in pieces.items()}},
                          layout)
        return True, None

    def segments(self) -> list[dict]:
        return [{"key": k.hex(), "parent": r[0].hex(), "idx": r[1], "tokens": r[2], "layout": r[4].hex()}
                for k, r in self.rows.items()]

    def load(self, key, deadline=None) -> tuple[dict | None, Miss | None]:
        if self.mode == "fail":
            return None, Miss("io", "injected read error (EIO)")
        if self.mode == "delay":
            time.sleep(self.delay_s)
            if deadline is not None and time.monotonic() > deadline:
                return None, Miss("timeout", "the read deadline passed")
        row = self.rows.get(key)
        if row is None:
            return None, Miss("missing", "no segment row")
        return {k: (p, _copy(d), pos) for k, (p, d, pos) in row[3].items()}, None

    def load_many(self, keys, deadline=None):
        return (self.load(key, deadline) for key in keys)

    def flush(self) -> bool:
        return True  # every save is done when it returns

    def take_failures(self) -> list[tuple[bytes, Miss]]:
        return []  # a save reports its own failure


def _copy(data):
    if isinstance(data, tuple):
        return tuple(_copy(t) for t in data)
    return None if data is None else data.clone()


def _from_lower_only(cache) -> None:
    """Forget every record in memory: the next hit must come from the lower tier."""
    cache.forget_memory()


def fail_lower_read(cache, records):
    _from_lower_only(cache)
    cache.lower.mode = "fail"
    return 1


def delay_lower_read(cache, records):
    _from_lower_only(cache)
    cache.lower.mode, cache.lower.delay_s = "delay", 0.05
    cache.config = replace(cache.config, lower_deadline_s=0.02, lower_deadline_per_token_s=0.0)
    return 1


DRILLS: dict[str, Callable] = {
    "evict_compressed": evict_compressed,
    "drop_tail": drop_tail,
    "expire_window": expire_window,
    "misalign_window": misalign_window,
    "invalidate_indexer": invalidate_indexer,
    "drop_gdn_checkpoint": drop_gdn_checkpoint,
    "corrupt_dtype": corrupt_dtype,
    "bump_version": bump_version,
    "change_topology": change_topology,
    "fail_lower_read": fail_lower_read,
    "delay_lower_read": delay_lower_read,
}


@dataclass(frozen=True)
class DrillReport:
    drill: str
    applies: bool  # the model has the state this drill damages
    logical_tokens: int
    usable_tokens: int
    exact: bool
    max_logit_diff: float
    outcome: str
    reasons: tuple[str, ...]
    paths: tuple[str, ...]

    @property
    def silent(self) -> bool:
        """Wrong output, or a damaged hit reported as a clean one."""
        wrong = self.max_logit_diff > 1e-4
        unreported = self.applies and self.outcome == "hit" and not self.reasons
        return wrong or unreported

    def as_dict(self) -> dict:
        return {"drill": self.drill, "applies": self.applies, "logical_tokens": self.logical_tokens,
                "usable_tokens": self.usable_tokens, "exact": self.exact, "max_logit_diff": self.max_logit_diff,
                "outcome": self.outcome, "reasons": list(self.reasons), "paths": list(self.paths),
                "silent": self.silent}


def run_drills(model, prompt_len: int = 96, block_size: int = 16, names: list[str] | None = None,
               seed: int = 0, config=None) -> list[DrillReport]:
    """`config`: the EngineConfig the drills' engines run with (default: the model's own)."""
    from engine.engine import Engine

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=g).tolist()
    probe = prompt + torch.randint(0, model.config.vocab_size, (5,), generator=g).tolist()
    cold = Engine(model, config).start(probe).logits
    reports = []
    for name in names or list(DRILLS):
        if name not in DRILLS:
            raise ValueError(f"unknown drill {name!r}; drills: {', '.join(DRILLS)}")
        cache = PrefixCache(model, CacheConfig(block_size=block_size, checkpoint_every=1), lower=MemoryTier())
        engine = Engine(model, config, cache=cache)
        engine.start(prompt).finish()
        damaged = DRILLS[name](cache, _records(cache, prompt))
        run = engine.start(probe)
        event = cache.last_lookup
        diff = (run.logits - cold).abs().max().item()
        paths = tuple(o.path for o in run.plan.objects if o.action == Action.RECOVER)
        reports.append(DrillReport(name, damaged > 0, run.plan.logical_tokens, run.plan.usable_tokens,
                                   run.plan.exact, diff, event.outcome, event.reasons, paths))
    return reports

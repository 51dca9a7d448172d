"""Four-layer validation: a logical hit becomes a usable hit only through `Validator.plan`.

1. whole-segment alignment   only whole verified segments are reused; a partial one is recomputed
2. kernel/layout interface   every record must carry the current layout fingerprint; a segment the
                             lower tier holds only under another format of the model's weights
                             (another dtype, int8) is refused here, with that reason
3. multi-group intersection  per state kind the longest prefix it can serve; the usable length is
                             the largest segment boundary that every kind serves (the intersection,
                             never the union)
4. byte-level alignment      dtype, shape, strides, contiguity and base alignment of each buffer,
                             checked by `check_buffer` when the state is assembled for compute

The result is a `ReusePlan`: what is reused, what each missing kind's recovery path is (see
recovery.py), the usable length and whether the result is exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import torch

from engine.cache.config import Reuse
from engine.cache.miss import Miss
from engine.cache.prefix_index import MatchResult
from engine.cache.recovery import route
from engine.cache.replay import ReplayChoice, ReplayPolicy, Seeds, choose
from engine.cache.state_table import StateTable
from engine.cache.states import Kind

ALIGNMENT = 16  # bytes: what vectorised CPU and GPU loads expect of a buffer's base address


class Action(str, Enum):
    REUSE = "reuse"
    RECOVER = "recover"
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class ObjectPlan:
    kind: str
    action: Action
    tokens: tuple[int, int]  # the token range this action covers
    layers: tuple[int, ...]
    path: str = ""
    reason: str = ""


@dataclass(frozen=True)
class ReusePlan:
    prompt_tokens: int
    logical_tokens: int  # what the prefix index matched, token-level
    matched_tokens: int  # verified whole segments with a record under the current layout
    usable_tokens: int  # what the validator lets compute start from
    keys: tuple[bytes, ...]  # the records the usable prefix is assembled from
    objects: tuple[ObjectPlan, ...]
    failures: tuple[Miss, ...]  # validation layer failures: kind "layer N", and what failed
    exact: bool = True
    granular_tokens: int = 0  # the most any plan could reuse: whole matched segments, one token left to compute
    notes: tuple[str, ...] = ()  # what is not a failure but explains the numbers (a partial last segment)
    replay_from: int | None = None  # tail replay: the model runs [replay_from, usable_tokens) to rebuild GDN states
    replay_starts: tuple[tuple[int, int], ...] = ()  # (layer, where its recurrent state restarts: zero or sketch)
    replay_bound: float = 0.0  # certified bound on the GDN state error the replay leaves (0: exact)
    replay_seed: int | None = None  # the boundary whose int8 GDN sketches seed the restart (else zero)
    replay_seeded: tuple[int, ...] = ()  # the GDN layers that restart from their sketch

    @property
    def replay_tokens(self) -> int:
        return 0 if self.replay_from is None else self.usable_tokens - self.replay_from

    @property
    def degraded(self) -> bool:
        """A logical hit that could not be used in full: validation gave up tokens that whole
        matched segments held (a match ending inside a segment is granularity, not degradation)."""
        return self.usable_tokens < self.granular_tokens

    def summary(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "logical_tokens": self.logical_tokens,
            "usable_tokens": self.usable_tokens, "exact": self.exact, "degraded": self.degraded,
            "granular_tokens": self.granular_tokens, "notes": list(self.notes),
            "replay": None if self.replay_from is None else [self.replay_from, self.usable_tokens],
            "replay_starts": [list(x) for x in self.replay_starts], "replay_bound": self.replay_bound,
            "replay_seed": self.replay_seed, "replay_seeded": list(self.replay_seeded),
            "objects": [{"kind": o.kind, "action": o.action.value, "tokens": list(o.tokens), "layers": list(o.layers),
                         "path": o.path, "reason": o.reason} for o in self.objects],
            "failures": [str(f) for f in self.failures],
        }


GDN_KINDS = frozenset({Kind.RECURRENT, Kind.CONV})
# boundary snapshots of the last few tokens before a boundary (V4-kind layers): a Tail-Replay
# rebuilds them from the tokens it runs, beside the GDN states, and reads the exact compressed
# entries and indexer keys from the cache (engine.model.v4_attention)
REBUILT_BY_REPLAY = frozenset({Kind.WINDOW, Kind.TAIL, Kind.OVERLAP, Kind.INDEX_TAIL, Kind.INDEX_OVERLAP})
# statistics and int8 sketches of GDN states: only an approximate plan reads them, never a requirement
OPTIONAL_KINDS = frozenset({Kind.DECAY, Kind.SKETCH})


@dataclass(frozen=True)
class Requirement:
    layer: int
    kind: str
    per_segment: bool


class Validator:
    def __init__(self, block_size: int, layout: bytes, requirements: list[Requirement],
                 policy: ReplayPolicy | None = None, replay_warmup: int = 0, exact_replay_cost: float | None = None):
        self.block_size = block_size
        self.replay_warmup = replay_warmup  # tokens before a recurrent restart that rebuild the conv state
        # exact policy: a replay of the whole match from its start costs this share of recomputing
        # it; below the share of the match a checkpoint leaves to recompute, the exact plan replays
        # instead (None: never; PrefixCache derives it from the model)
        self.exact_replay_cost = exact_replay_cost
        self.layout = layout
        self.requirements = tuple(requirements)
        # what every plan reads of them, derived once: every lookup plans, so a plan does little else
        self._per_segment = [r for r in self.requirements if r.per_segment]
        self._need = {(r.layer, r.kind) for r in self._per_segment}
        self._snapshots = {(r.layer, r.kind) for r in self.requirements if not r.per_segment}
        self._reuse_kinds = ",".join(sorted({r.kind for r in self.requirements}))
        self._all_layers = tuple(sorted({r.layer for r in self.requirements}))
        self._gdn_layers = sorted({r.layer for r in self.requirements if r.kind in GDN_KINDS})
        self.policy = policy or ReplayPolicy()
        # Tail-Replay needs GDN states to rebuild, every token-addressable kind (full-attention KV,
        # compressed entries, indexer keys) read exact at any boundary, and every other snapshot
        # kind one the replay rebuilds too (windows, tails, overlaps)
        snapshot_kinds = {r.kind for r in requirements if not r.per_segment}
        self.replayable = bool(snapshot_kinds & GDN_KINDS) and snapshot_kinds <= GDN_KINDS | REBUILT_BY_REPLAY
        # the exact policy's whole-match replay pays only where the replay rebuilds GDN states
        # alone: windows and compressors rebuilt beside them made it slower than a prefill
        self.exact_replayable = bool(snapshot_kinds & GDN_KINDS) and snapshot_kinds <= GDN_KINDS

    def plan(self, prompt_len: int, match: MatchResult, table: StateTable,
             foreign: Mapping[bytes, str] | None = None) -> ReusePlan:
        """`foreign`: segments that the table lacks and the lower tier holds only under another
        layout of the same model (PrefixCache.foreign): key -> what differs."""
        b = self.block_size
        failures: list[Miss] = []
        notes: list[str] = []
        # reuse must leave at least one prompt token to compute: its logits start the answer
        n = n_asked = min(len(match.segments), (prompt_len - 1) // b)
        if match.logical_tokens > n * b:
            notes.append(f"tokens [{n * b}, {match.logical_tokens}) match only part of a segment (or the prompt's "
                         "last token); recomputed")
        if match.collisions:
            failures.append(Miss("layer 1", f"{match.collisions} hash hit(s) rejected by token comparison"))

        records, keys = [], []
        unavailable = first_approximate = None
        # per-segment kinds serve every boundary up to their first gap; the common case (a record
        # holding all of them) is one set inclusion, the per-kind search runs only past a gap
        per_segment, need = self._per_segment, self._need
        complete = None
        get, layout, exact_only = table.records.get, self.layout, self.policy.mode == Reuse.EXACT
        for j, node in enumerate(match.segments[:n]):
            rec = get(node.key)
            if rec is None and foreign and node.key in foreign:
                failures.append(Miss("layer 2", f"segment {j} was written under another layout fingerprint: "
                                                f"{foreign[node.key]}"))
                break
            if rec is None:
                failures.append(Miss("layer 3", f"segment {j} has no state record"))
                unavailable = j
                break
            if rec.layout != layout:
                failures.append(Miss("layer 2", f"segment {j} was written under another layout fingerprint"))
                break
            if not rec.exact and exact_only:
                failures.append(Miss("layer 3", f"segment {j} holds approximate (tail-replayed) state; the policy is exact"))
                break
            if complete is None and not need <= rec.pieces.keys():
                complete = j
            if first_approximate is None and not rec.exact:
                first_approximate = j
            records.append(rec)
            keys.append(node.key)
        n = len(records)
        if complete is None:
            complete = n
        gap_of: dict[tuple[int, str], int] = {}
        for req in per_segment:
            key = (req.layer, req.kind)
            gap_of[key] = next((j for j in range(complete, n) if key not in records[j].pieces), n)
        limit = complete
        # boundary kinds need their snapshot exactly at the chosen boundary
        k = limit
        snapshots = self._snapshots
        while k > 0 and not snapshots <= records[k - 1].pieces.keys():
            k -= 1

        if self.policy.mode == Reuse.APPROXIMATE and self.replayable and k < limit:
            approximate = not all(r.exact for r in records[:limit])
            plan = self._tail_replay(_Matched(prompt_len, match, records, limit, k, failures, notes, n_asked), approximate)
            if plan is not None:
                return plan
        elif (self.policy.mode == Reuse.EXACT and self.exact_replayable and k < limit and self.exact_replay_cost is not None
              and self.exact_replay_cost * limit < limit - k):
            # no checkpoint near the end of the match: replaying the GDN layers from the prefix
            # start over the cached KV is exact and costs less than recomputing from the checkpoint
            layers = self._gdn_layers
            full = ReplayChoice(0, limit * b, tuple((layer, 0) for layer in layers), tuple((layer, 0.0) for layer in layers))
            return self._replay_plan(_Matched(prompt_len, match, records, limit, k, failures, notes, n_asked), full,
                                     exact=True)

        objects: list[ObjectPlan] = []
        if unavailable is not None:
            r = route("on_disk")
            objects.append(ObjectPlan("on_disk", Action.RECOVER, (unavailable * b, min(len(match.segments), n_asked) * b),
                                      (), r.path, f"segment {unavailable} is a logical hit that is not in memory"))
        lost: dict[str, list[int]] = {}
        whole = n == 0 or (k == n and complete == n)  # every kind held up to the last record: none lost
        for req in () if whole else self.requirements:
            if req.per_segment and gap_of[(req.layer, req.kind)] < n:
                lost.setdefault(req.kind, []).append(req.layer)
            elif not req.per_segment and n > 0 and not records[n - 1].has(req.layer, req.kind):
                lost.setdefault(req.kind, []).append(req.layer)
        for kind, layers in lost.items():
            r = route(kind)
            objects.append(ObjectPlan(kind, Action.RECOVER, (k * b, n * b), tuple(layers), r.path,
                                      f"{kind} missing for the matched prefix of {n * b} tokens; resume at {k * b}"))
            failures.append(Miss("layer 3", f"{kind} missing in layers {layers}"))
        if k:
            objects.insert(0, ObjectPlan(self._reuse_kinds, Action.REUSE, (0, k * b), self._all_layers))
        objects.append(ObjectPlan("all", Action.RECOMPUTE, (k * b, prompt_len), (), "prefill"))
        return ReusePlan(prompt_len, match.logical_tokens, n * b, k * b, tuple(keys[:k]),
                         tuple(objects), tuple(failures), exact=first_approximate is None or first_approximate >= k,
                         granular_tokens=n_asked * b, notes=tuple(notes))

    def _tail_replay(self, m: _Matched, approximate: bool) -> ReusePlan | None:
        """Reuse every token-addressable state up to `limit` segments and rebuild the GDN states by
        replaying a tail from zero (the budget's, or per layer the shortest whose certified bound
        is within tolerance) -- unless the nearest exact checkpoint (at k) lies inside it, which
        the exact plan then uses. None: the exact plan applies."""
        b, records, limit, k = self.block_size, m.records, m.limit, m.k
        end = limit * b
        gdn_layers = self._gdn_layers
        if any(not all((layer, Kind.DECAY) in r.pieces for r in records[:limit]) for layer in gdn_layers):
            return None  # no statistics to certify a replay with
        decay = {layer: torch.cat([r.pieces[(layer, Kind.DECAY)].data for r in records[:limit]], dim=1)
                 for layer in gdn_layers}
        first = next(iter(decay.values()))
        stride = b // max(1, first.shape[1] // limit) if limit else 1
        seeds = self._seeds(records, limit, (first.shape[0], first.shape[2]))
        pick = choose(self.policy, end, decay, self.replay_warmup, stride, seeds)
        if pick is None or (k > 0 and k * b >= pick.begin):
            return None  # nothing within the budget, or a checkpoint inside the window: replay from it, exactly
        return self._replay_plan(m, pick, exact=pick.bound == 0.0 and not approximate)

    def _seeds(self, records, limit: int, shape: tuple[int, int]) -> Seeds | None:
        """The boundaries up to `limit` segments (within the budget) where every GDN layer kept an
        int8 sketch of its state, with the sketches' exact errors."""
        b, gdn_layers = self.block_size, self._gdn_layers
        lowest = self.policy.earliest_restart(limit * b, self.replay_warmup)
        at = [j for j in range(max(0, lowest // b - 1), limit)
              if (j + 1) * b >= lowest and all(_sketch_fits(records[j].pieces.get((layer, Kind.SKETCH)), shape)
                                               for layer in gdn_layers)]
        if not at:
            return None
        return Seeds(tuple((j + 1) * b for j in at),
                     {layer: torch.stack([records[j].pieces[(layer, Kind.SKETCH)].data[2] for j in at], dim=1)
                      for layer in gdn_layers})

    def _replay_plan(self, m: _Matched, pick: ReplayChoice, exact: bool) -> ReusePlan:
        """The plan that reuses every token-addressable state up to `limit` segments and replays
        [pick.begin, limit * B) to rebuild the GDN states (and the snapshots replay rebuilds)."""
        b, records, limit, k, notes = self.block_size, m.records, m.limit, m.k, m.notes
        end = limit * b
        rebuilt = GDN_KINDS | REBUILT_BY_REPLAY
        other = sorted({r.kind for r in self.requirements if r.kind not in rebuilt})
        replayed = sorted({r.kind for r in self.requirements if r.kind in rebuilt})
        how = "exact: from the prefix start" if exact else f"approximate, error bound {pick.bound:.2e}"
        others = sorted(set(self._gdn_layers) - set(pick.seeded))
        origin = ("from a zero state" if pick.seed is None else f"from the int8 GDN sketches at {pick.seed}"
                  + (f" (layers {others} from zero)" if others else ""))
        objects = (
            ObjectPlan(",".join(other), Action.REUSE, (0, end), tuple(sorted({r.layer for r in self.requirements
                                                                            if r.kind not in rebuilt}))),
            ObjectPlan(",".join(replayed), Action.RECOVER, (pick.begin, end),
                       tuple(sorted({r.layer for r in self.requirements if r.kind in rebuilt})),
                       f"tail replay of {end - pick.begin} tokens {origin} ({how})",
                       f"no GDN checkpoint in [{pick.begin}, {end}]; nearest at {k * b}" if k * b < pick.begin
                       else f"the nearest GDN checkpoint, at {k * b}, leaves more to recompute than this replay"),
            ObjectPlan("all", Action.RECOMPUTE, (end, m.prompt_len), (), "prefill"),
        )
        cap = self.policy.tokens(end) if self.policy.mode == Reuse.APPROXIMATE else None
        if set(replayed) - GDN_KINDS:
            notes = notes + [f"{', '.join(k for k in replayed if k not in GDN_KINDS)} rebuilt by the same replay; "
                             "compressed entries read exact from the cache"]
        notes = notes + [f"GDN states rebuilt by replaying tokens [{pick.begin}, {end})"
                         + (f" (budget {cap} tokens)" if cap is not None else "")
                         + (" (exact policy: cheaper than recomputing from the nearest checkpoint)"
                            if self.policy.mode == Reuse.EXACT else "")
                         + (f"; per-layer restarts {dict(pick.starts)}" if self.policy.adaptive else "")]
        return ReusePlan(m.prompt_len, m.match.logical_tokens, len(records) * b, end,
                         tuple(r.key for r in records[:limit]), objects, tuple(m.failures), exact=exact,
                         granular_tokens=m.n_asked * b, notes=tuple(notes), replay_from=pick.begin,
                         replay_starts=pick.starts, replay_bound=pick.bound, replay_seed=pick.seed,
                         replay_seeded=pick.seeded)


@dataclass(frozen=True)
class _Matched:
    """What a lookup matched, as the replay plans read it: the prompt's length, the index match,
    the usable records, `limit` segments whose token-addressable states are whole, the nearest
    exact checkpoint at `k` segments, the failures and notes so far, and the segments asked for."""

    prompt_len: int
    match: MatchResult
    records: list
    limit: int
    k: int
    failures: list[Miss]
    notes: list[str]
    n_asked: int


def _sketch_fits(piece, shape: tuple[int, int]) -> bool:
    """A sketch piece whose recorded errors can be read ([B, H] like the decay statistics'); the
    codes and scales are checked at assembly (layer 4) like any buffer."""
    data = piece.data if piece is not None else None
    return isinstance(data, tuple) and len(data) == 3 and isinstance(data[2], torch.Tensor) and \
        tuple(data[2].shape) == shape


def check_buffer(t: torch.Tensor, like: torch.Tensor, device: torch.device) -> str | None:
    """Layer 4: why `t` cannot be handed to compute in place of a buffer shaped like `like` (the
    same piece of a fresh state, whose token dimensions are 0 and so match any length), or None.
    The GDN recurrent matrix is float32 in every model dtype, so dtype comes from `like` too."""
    if t.dtype != like.dtype:
        return f"dtype {t.dtype} != {like.dtype}"
    shape, want = t.shape, like.shape
    if len(shape) != len(want) or any(w and a != w for a, w in zip(shape, want)):
        return f"shape {tuple(shape)} does not fit {tuple(want)}"
    if t.device != device:
        return f"device {t.device} != {device}"
    if not t.is_contiguous():
        return f"strides {t.stride()} are not contiguous"
    if t.numel() and t.data_ptr() % ALIGNMENT:
        return f"base address {t.data_ptr():#x} is not {ALIGNMENT}-byte aligned"
    return None

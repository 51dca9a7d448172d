"""Per-request layer state objects: what each layer kind keeps between forward calls.

The model's modules hold weights only; everything a layer remembers about a sequence lives in one
of these objects, owned by the caller. That is what lets the cache layer snapshot, validate and
rebuild each state on its own.

    full_attention    KVState   exact keys/values for every position [0, length), one buffer
                      PagedKVState  the same in fixed-size blocks of a pool, through a block table
                                (the paged-attention kernels' layout; HCW_KV picks, see kv_layout)
    linear_attention  GDNState  conv window (last K-1 projected inputs) + recurrent matrix per head
"""

from __future__ import annotations

import math
import os

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True)
class StateObject:
    """One piece of per-sequence state, as the cache layer sees it: what it is, where its content
    comes from, and what it costs. Every layer kind describes its state only through these.

    Token-addressable objects hold `entries` entries; entry i derives from tokens
    `entry_range(i)`: a window of `span` tokens ending at first + (i + 1) * stride. Objects that
    are not token-addressable (a recurrent matrix) summarise all of `tokens` at once.
    """

    layer: int
    kind: str  # kv | conv | recurrent | window | compressed | tail | overlap | index_keys | index_tail | index_overlap
    shape: tuple[int, ...]
    token_addressable: bool
    tokens: tuple[int, int]  # [lo, hi): the token positions this object's content derives from
    nbytes: int
    entries: int = 0
    stride: int = 1
    span: int = 1
    first: int = 0

    def entry_range(self, i: int) -> tuple[int, int]:
        if not 0 <= i < self.entries:
            raise IndexError(f"{self.kind} of layer {self.layer} has {self.entries} entries, not {i + 1}")
        hi = self.first + (i + 1) * self.stride
        return max(0, hi - self.span), hi


@dataclass(frozen=True)
class Piece:
    """What the cache keeps of one state kind for one segment [lo, hi).

    per_segment: the slice produced by the segment's own tokens (KV, compressed entries, index
    keys); a prefix needs the pieces of every segment before it. Otherwise a snapshot of the
    state exactly at hi (GDN recurrent and conv, SWA window, tails, overlaps); a prefix ending
    at hi needs that one snapshot. `data` is a tensor or a tuple of tensors; an empty state is a
    zero-length tensor, never None, so every piece can be held to its template's shape and dtype."""

    per_segment: bool
    data: object
    position: int = -1  # the token position the piece ends at / describes; stamped when cached

    def nbytes(self) -> int:
        items = self.data if isinstance(self.data, tuple) else (self.data,)
        return sum(_nbytes(t) for t in items if t is not None)


class LayerState(Protocol):
    """What every per-layer state object offers the cache layer."""

    def objects(self, layer: int, seq_len: int) -> list[StateObject]: ...
    def nbytes(self) -> int: ...
    # copies of this state's pieces for the segment [lo, hi): its per-segment slices, and, when
    # `snapshots`, the snapshots (which describe the state's current seq_len, so it must be hi)
    def export(self, lo: int, hi: int, snapshots: bool = True) -> dict[str, Piece]: ...
    # a new state at seq_len from pieces (per-segment kinds: a list in segment order), with this
    # (fresh) state as the template for shapes, dtypes and rates
    def assemble(self, seq_len: int, pieces: dict[str, object]) -> LayerState: ...


def _clone(x):
    if x is None:
        return None
    if isinstance(x, tuple):
        return tuple(_clone(t) for t in x)
    return x.clone()


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _tokens(layer: int, kind: str, t: torch.Tensor, first: int, dim: int = 1) -> StateObject:
    """An object whose entries are single consecutive tokens starting at `first`."""
    n = t.shape[dim]
    return StateObject(layer, kind, tuple(t.shape), True, (first, first + n), _nbytes(t), n, 1, 1, first)


@dataclass
class KVState:
    """Keys and values of one full-attention layer, grown in place (amortised doubling)."""

    k: torch.Tensor  # [B, Hkv, capacity, D]
    v: torch.Tensor  # [B, Hkv, capacity, D]
    length: int = 0

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, dtype, device, capacity: int = 256) -> KVState:
        shape = (batch, heads, capacity, head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write [B, Hkv, T, D] at the end; return views of all keys and values so far."""
        end = self.length + k_new.shape[2]
        self.room(end)
        self.k[:, :, self.length:end] = k_new
        self.v[:, :, self.length:end] = v_new
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def room(self, end: int) -> None:
        """Capacity for positions [0, end), grown by doubling; what is held is kept."""
        if end > self.k.shape[2]:
            self._grow(end)

    def written(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Count the t positions a kernel wrote straight into k and v after the held ones (room
        made first); return views of all keys and values so far, as `append` does."""
        end = self.length + t
        if end > self.k.shape[2]:
            raise IndexError(f"{t} positions written past a KV capacity of {self.k.shape[2]}")
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def read(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, end) already held: a replay reads them, never writes."""
        if end > self.length:
            raise IndexError(f"positions up to {end} asked of a KV state holding {self.length}")
        return self.k[:, :, :end], self.v[:, :, :end]

    def _grow(self, needed: int) -> None:
        cap = max(needed, 2 * self.k.shape[2])
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.empty((*old.shape[:2], cap, old.shape[3]), dtype=old.dtype, device=old.device)
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def nbytes(self) -> int:
        per_pos = self.k.shape[0] * self.k.shape[1] * self.k.shape[3] * self.k.element_size()
        return 2 * per_pos * self.length

    def objects(self, layer: int, seq_len: int) -> list[StateObject]:
        shape = (2, self.k.shape[0], self.k.shape[1], self.length, self.k.shape[3])
        return [StateObject(layer, "kv", shape, True, (0, self.length), self.nbytes(), self.length)]

    def export(self, lo: int, hi: int, snapshots: bool = True) -> dict[str, Piece]:
        return {"kv": Piece(True, (self.k[:, :, lo:hi].clone(), self.v[:, :, lo:hi].clone()))}

    def assemble(self, seq_len: int, pieces: dict[str, object]) -> KVState:
        """One buffer per tensor with room past seq_len (an eighth more, at least 256 positions) for
        the request's new tokens: appending to an exact-size buffer copied every restored key and
        value again (~5 ms of a 32K resume)."""
        parts = pieces["kv"]
        held = sum(p[0].shape[2] for p in parts)
        if held != seq_len:  # (cat into a view of the wrong length would scramble it, not fail)
            raise ValueError(f"the pieces hold {held} positions, not {seq_len}")
        first = parts[0][0]
        b, h, _, d = first.shape
        room = seq_len + max(256, seq_len // 8)
        k, v = first.new_empty(b, h, room, d), first.new_empty(b, h, room, d)
        torch.cat([p[0] for p in parts], dim=2, out=k[:, :, :seq_len])
        torch.cat([p[1] for p in parts], dim=2, out=v[:, :, :seq_len])
        return KVState(k, v, seq_len)


KV_LAYOUTS = ("auto", "dense", "paged")
PAGE = 64  # positions per block of a paged KV state (a power of two: the Triton kernels tile by it)


def kv_layout(device) -> str:
    """How full-attention layers keep keys and values: HCW_KV=dense (one buffer per layer, read by
    scaled_dot_product_attention), paged (a block pool and a block table, read by the paged-attention
    kernels: Triton on CUDA, their torch reference elsewhere), or auto (unset): paged on CUDA, dense
    elsewhere, where the reference's per-sequence gather costs more than one contiguous buffer."""
    value = os.environ.get("HCW_KV", "auto") or "auto"
    if value not in KV_LAYOUTS:
        raise ValueError(f"HCW_KV={value!r}; one of {', '.join(KV_LAYOUTS)}")
    if value == "auto":
        return "paged" if torch.device(device).type == "cuda" else "dense"
    return value


@dataclass
class PagedKVState:
    """Keys and values of one full-attention layer in blocks of PAGE positions.

    The pools are [N, Hkv, PAGE, D]; sequence b's j-th block is pool block j * B + b, so growing
    the pool appends blocks and never moves a sequence's earlier ones, and the blocks of one
    position range form one [B, ...] slab that a write fills with a single strided copy. `table`
    ([B, M] int32) and `lengths` ([B] int32) are the kernels' view of the same thing. Everything the
    cache sees (objects, export, assemble) is the same as KVState's: pieces are dense either way."""

    k_pool: torch.Tensor  # [N, Hkv, PAGE, D], N = M * B
    v_pool: torch.Tensor
    table: torch.Tensor  # [B, M] int32
    lengths: torch.Tensor  # [B] int32: positions held, the same for every sequence
    length: int = 0
    at: torch.Tensor | None = None  # static decode (engine/static_decode.py): the new token's position, [1] long

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, dtype, device, capacity: int = 256) -> PagedKVState:
        blocks = -(-capacity // PAGE)
        pools = [torch.empty(blocks * batch, heads, PAGE, head_dim, dtype=dtype, device=device) for _ in range(2)]
        return cls(*pools, _table(batch, blocks, device), torch.zeros(batch, dtype=torch.int32, device=device))

    @property
    def batch(self) -> int:
        return self.table.shape[0]

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write [B, Hkv, T, D] at positions length..length+T-1 (the kernels then read them)."""
        end = self.length + k_new.shape[2]
        self.reserve(end)
        b = self.batch
        for pool, new in ((self.k_pool, k_new), (self.v_pool, v_new)):
            slabs = pool.view(-1, b, *pool.shape[1:])  # [M, B, Hkv, PAGE, D]
            at = self.length
            while at < end:
                j, lo = divmod(at, PAGE)
                hi = min(PAGE, lo + end - at)
                slabs[j, :, :, lo:hi] = new[:, :, at - self.length:at - self.length + hi - lo]
                at += hi - lo
        self.length = end
        self.lengths.fill_(end)

    def write_at(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Static decode: [B, Hkv, 1, D] written at the position `at` holds and `lengths` set past
        it, all in tensors (the caller keeps `length` and has made sure the block exists)."""
        block = self.table.index_select(1, torch.div(self.at, PAGE, rounding_mode="floor"))[:, 0].long()  # [B]
        offset = self.at % PAGE
        self.k_pool[block, :, offset] = k_new[:, :, 0]
        self.v_pool[block, :, offset] = v_new[:, :, 0]
        self.lengths.copy_(self.at + 1)

    def reserve(self, end: int) -> None:
        """Blocks through position end-1 (static decode reserves ahead: it must never grow the pools)."""
        if end > self.table.shape[1] * PAGE:
            self._grow(end)

    def read(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, end) as dense [B, Hkv, end, D] copies (a replay reads them)."""
        if end > self.length:
            raise IndexError(f"positions up to {end} asked of a KV state holding {self.length}")
        return self._dense(0, end)

    def _dense(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [lo, hi) as [B, Hkv, hi-lo, D] tensors of their own: the blocks they lie in
        gathered out of the pool (kernels.segments.gather: Triton on CUDA), then cut to the range."""
        from kernels.segments import gather

        b, first, last = self.batch, lo // PAGE, -(-hi // PAGE)
        ids = self.table[:, first:last].flatten().clone()  # b's blocks in order, aligned (kernels check)
        out = []
        for pool in (self.k_pool, self.v_pool):
            blocks = gather(pool, ids, trusted=True).view(b, last - first, *pool.shape[1:])  # [B, m, Hkv, PAGE, D]
            run = blocks.transpose(1, 2).reshape(b, pool.shape[1], -1, pool.shape[3])
            cut = run[:, :, lo - first * PAGE:hi - first * PAGE]
            out.append(cut if cut.shape[2] == run.shape[2] else cut.clone())  # no view pinning the rest
        return out[0], out[1]

    def _grow(self, needed: int) -> None:
        blocks = max(-(-needed // PAGE), 2 * self.table.shape[1])
        b = self.batch
        for name in ("k_pool", "v_pool"):
            old = getattr(self, name)
            new = torch.empty(blocks * b, *old.shape[1:], dtype=old.dtype, device=old.device)
            new[: old.shape[0]] = old  # block j * B + b keeps its id
            setattr(self, name, new)
        self.table = _table(b, blocks, self.table.device)

    def nbytes(self) -> int:
        per_pos = self.batch * self.k_pool.shape[1] * self.k_pool.shape[3] * self.k_pool.element_size()
        return 2 * per_pos * self.length

    def objects(self, layer: int, seq_len: int) -> list[StateObject]:
        shape = (2, self.batch, self.k_pool.shape[1], self.length, self.k_pool.shape[3])
        return [StateObject(layer, "kv", shape, True, (0, self.length), self.nbytes(), self.length)]

    def export(self, lo: int, hi: int, snapshots: bool = True) -> dict[str, Piece]:
        return {"kv": Piece(True, self._dense(lo, hi))}

    def assemble(self, seq_len: int, pieces: dict[str, object]) -> PagedKVState:
        """A state holding the pieces' first seq_len positions, written into its pool's blocks at
        once (kernels.segments.scatter: Triton on CUDA)."""
        from kernels.segments import scatter

        b, heads, d = self.batch, self.k_pool.shape[1], self.k_pool.shape[3]
        state = PagedKVState.empty(b, heads, d, self.k_pool.dtype, self.k_pool.device, capacity=max(seq_len, 1))
        m = -(-seq_len // PAGE)
        ids = state.table[:, :m].flatten().clone()
        for pool, i in ((state.k_pool, 0), (state.v_pool, 1)):
            run = torch.cat([p[i] for p in pieces["kv"]], dim=2)[:, :, :seq_len]
            if seq_len % PAGE:  # the last block's unused positions: never read (lengths stops before them)
                run = torch.cat([run, run.new_zeros(b, heads, m * PAGE - seq_len, d)], dim=2)
            blocks = run.reshape(b, heads, m, PAGE, d).transpose(1, 2).reshape(b * m, heads, PAGE, d)
            scatter(pool, ids, blocks, trusted=True)
        state.length = seq_len
        state.lengths.fill_(seq_len)
        return state


def _table(batch: int, blocks: int, device) -> torch.Tensor:
    """[B, M] int32: sequence b's j-th block is pool block j * B + b."""
    ids = torch.arange(blocks * batch, dtype=torch.int32, device=device)
    return ids.view(blocks, batch).t().contiguous()


STAT_STRIDE = 16  # tokens per cached decay statistic: Tail-Replay restarts at multiples of it


def sketch(recurrent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An int8 sketch of a GDN recurrent state [B, Hv, Dk, Dv] (about a quarter of its bytes):
    symmetric per-row codes, the rows' scales, and the sketch's exact error |S - unsketch|_F per
    batch and head (float64, rounded up), which is what Tail-Replay certifies a replay seeded
    with it by (engine/cache/replay.py)."""
    s = recurrent.float()
    scale = (s.abs().amax(-1, keepdim=True) / 127.0).clamp_min(1e-30)
    codes = torch.round(s / scale).clamp_(-127, 127).to(torch.int8)
    error = (s.double() - (codes.float() * scale).double()).flatten(2).norm(dim=-1) * (1 + 1e-6)
    return codes, scale, error


def unsketch(piece: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    codes, scale, _ = piece
    return codes.float() * scale


@dataclass
class GDNState:
    """Gated DeltaNet state: not token-addressable, it only ever describes the whole prefix.

    Beside the state it keeps, per token and value head, the log-decay g_t and an upper bound
    N_t on the state's Frobenius norm (N_t = exp(g_t) N_{t-1} + beta_t |v_t|, which holds because
    k is unit-norm and 0 < beta < 1): the "decay" statistics Tail-Replay certifies its error with.
    They are exported per segment; `stats_end` is the position they run to (a replay, which
    revisits earlier positions, does not record them)."""

    conv: torch.Tensor  # [B, conv_dim, K-1]: the last K-1 projected q/k/v inputs, oldest first
    recurrent: torch.Tensor  # [B, Hv, Dk, Dv] float32
    stats: torch.Tensor = None  # [B, capacity, Hv, 2] float32: (g_t, N_t) for positions stats_start..
    stats_start: int = 0
    stats_end: int = 0
    norm: torch.Tensor = None  # [B, Hv] float64: N at stats_end
    tracking: bool = False  # only a state the prefix cache records keeps statistics
    # static decode (engine/static_decode.py): conv and recurrent are updated in place, and a step's
    # statistics go to `step` ([B, Hv, 2]) for the decoder to `commit_step` outside the captured step
    static: bool = False
    step: torch.Tensor = None
    step_norm: torch.Tensor = None  # [B, Hv] float64: N after the static step, `norm` once committed
    # a Tail-Replay seeded by a sketch: the recurrent state its restart takes (else zero), once
    seed: torch.Tensor = None

    def __post_init__(self) -> None:
        b, heads = self.recurrent.shape[:2]
        if self.stats is None:
            self.stats = torch.zeros(b, 0, heads, 2, dtype=torch.float32, device=self.recurrent.device)
        if self.norm is None:
            self.norm = torch.zeros(b, heads, dtype=torch.float64, device=self.recurrent.device)

    @classmethod
    def zeros(cls, batch: int, conv_dim: int, kernel: int, heads: int, dk: int, dv: int, dtype, device) -> GDNState:
        return cls(torch.zeros(batch, conv_dim, kernel - 1, dtype=dtype, device=device),
                   torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=device))

    def record(self, start: int, g: torch.Tensor, x: torch.Tensor) -> None:
        """Append the statistics of positions start.. (g: log-decay, x: beta * |v|, [B, T, Hv])
        when they continue the recorded ones; a replay of earlier positions records nothing."""
        if not self.tracking:
            return
        if self.static:  # tensors only, into `step`: commit_step decides whether they continue
            n = self._next_norm(g, x)
            self.step_norm.copy_(n)
            self.step[..., 0].copy_(g[:, 0])
            self.step[..., 1].copy_(n)
            return
        if start != self.stats_end:
            return
        if g.shape[1] == 1:  # decode: the recurrence itself, three small ops
            n = self._next_norm(g, x).unsqueeze(1)
        else:
            g64, x64 = g.double(), x.double()
            cum = g64.cumsum(1)  # G_t: log-decay from the chunk start through t
            # N_t = exp(G_t) N_0 + sum_{s<=t} exp(G_t - G_s) x_s, the sum through logcumsumexp
            tail = torch.logcumsumexp(torch.log(x64.clamp_min(1e-300)) - cum, dim=1)
            n = (torch.exp(cum) * self.norm[:, None] + torch.exp(cum + tail)) * (1 + 1e-6)
        # (rounding up by 1e-6 keeps N an upper bound after float32 storage)
        rows = self._stats_rows(g.shape[1])
        rows[..., 0] = g
        rows[..., 1] = n.float()
        self.norm = n[:, -1]

    def _next_norm(self, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """N after one token: e^g N + x, rounded up (float64, [B, Hv])."""
        return (torch.exp(g[:, 0].double()) * self.norm + x[:, 0].double()) * (1 + 1e-6)

    def _stats_rows(self, n: int) -> torch.Tensor:
        """The next n rows of `stats` ([B, n, Hv, 2], grown if needed), counted as recorded."""
        used = self.stats_end - self.stats_start
        if used + n > self.stats.shape[1]:
            grown = self.stats.new_zeros(self.stats.shape[0], max(used + n, 2 * self.stats.shape[1], 256),
                                         *self.stats.shape[2:])
            grown[:, :used] = self.stats[:, :used]
            self.stats = grown
        self.stats_end += n
        return self.stats[:, used:used + n]

    def commit_step(self, start: int) -> None:
        """After a static decode step at position `start`: its statistics (in `step`) kept as
        record() would — only when they continue the recorded ones."""
        if not self.tracking or start != self.stats_end:
            return
        self.norm.copy_(self.step_norm)
        self._stats_rows(1)[:, 0] = self.step

    def resume_stats(self, seq_len: int, decay_pieces: list[torch.Tensor] | None) -> None:
        """Continue the statistics at seq_len from the segments' recorded ones (after assembly);
        without them the norm is unknown (inf), and no replay from this prefix is ever certified."""
        self.stats = self.stats[:, :0]
        self.stats_start = self.stats_end = seq_len
        last = next((p for p in reversed(decay_pieces) if p.shape[1]), None) if decay_pieces else None
        if last is not None:
            self.norm = last[:, -1, :, 1].double()
        else:
            self.norm = torch.full_like(self.norm, 0.0 if seq_len == 0 else float("inf"))

    def _forget_stats_before(self, pos: int) -> None:
        """Segments are exported in order, once: what precedes the last export is not needed again."""
        if pos > self.stats_start:
            self.stats = self.stats[:, pos - self.stats_start:self.stats_end - self.stats_start].clone()
            self.stats_start = pos

    def nbytes(self) -> int:
        return _nbytes(self.conv) + _nbytes(self.recurrent) + _nbytes(self.stats)

    def objects(self, layer: int, seq_len: int) -> list[StateObject]:
        held = self.conv.shape[-1]
        used = self.stats[:, :self.stats_end - self.stats_start]
        return [
            StateObject(layer, "recurrent", tuple(self.recurrent.shape), False, (0, seq_len), _nbytes(self.recurrent)),
            # the conv window is the last K-1 inputs, but it only means something at exactly seq_len
            StateObject(layer, "conv", tuple(self.conv.shape), False, (max(0, seq_len - held), seq_len),
                        _nbytes(self.conv)),
            _tokens(layer, "decay", used, self.stats_start),
        ]

    def export(self, lo: int, hi: int, snapshots: bool = True, sketches: bool = False) -> dict[str, Piece]:
        """`sketches`: an int8 sketch of the recurrent state at hi too (a snapshot: needs the
        state at hi), which only seeds an approximate replay."""
        out = {}
        if self.stats_start <= lo and hi <= self.stats_end:
            # per group of `stride` tokens: the summed log-decay and N at the group's end, which is
            # all a bound at the group boundaries needs (16x smaller than per token)
            n = hi - lo
            stride = math.gcd(STAT_STRIDE, n) if n else 1
            seg = self.stats[:, lo - self.stats_start:hi - self.stats_start]
            seg = seg.reshape(seg.shape[0], n // stride, stride, *seg.shape[2:])
            out["decay"] = Piece(True, torch.stack([seg[..., 0].sum(2), seg[:, :, -1, :, 1]], dim=-1))
            self._forget_stats_before(hi)
        if snapshots:
            out["recurrent"] = Piece(False, self.recurrent.clone())
            out["conv"] = Piece(False, self.conv.clone())
        if sketches:
            out["sketch"] = Piece(False, sketch(self.recurrent))
        return out

    def assemble(self, seq_len: int, pieces: dict[str, object]) -> GDNState:
        state = GDNState(conv=pieces["conv"].clone(), recurrent=pieces["recurrent"].clone())
        state.resume_stats(seq_len, pieces.get("decay"))
        return state


@dataclass
class ModelState:
    """All layer states of one sequence plus how many tokens they describe."""

    layers: list[KVState | PagedKVState | GDNState | V4AttnState]
    seq_len: int = 0
    extra: dict = field(default_factory=dict)

    def track_statistics(self) -> ModelState:
        """Have every layer that keeps statistics for the cache (GDN decay) record them."""
        for layer in self.layers:
            if hasattr(layer, "tracking"):
                layer.tracking = True
        return self

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.layers)

    def objects(self) -> list[StateObject]:
        return [obj for i, s in enumerate(self.layers) for obj in s.objects(i, self.seq_len)]


@dataclass
class WindowState:
    """Sliding window: the shared key/value vectors of the last W-1 positions, [B, n, D], n <= W-1."""

    kv: torch.Tensor
    end: int = 0  # the position after the newest stored entry

    @property
    def start(self) -> int:
        return self.end - self.kv.shape[1]

    def nbytes(self) -> int:
        return _nbytes(self.kv)

    def objects(self, layer: int, seq_len: int) -> list[StateObject]:
        return [_tokens(layer, "window", self.kv, self.start)]

    def export(self, lo: int, hi: int, snapshots: bool = True) -> dict[str, Piece]:
        return {"window": Piece(False, self.kv.clone())} if snapshots else {}

    def assemble(self, seq_len: int, pieces: dict[str, object]) -> WindowState:
        return WindowState(pieces["window"].clone(), seq_len)


@dataclass
class CompressedState:
    """A compressor's memory: closed windows as entries, the open window's raw projections (the
    uncompressed tail) and, for overlapping (CSA-style) compressors, the overlap slice of the last
    closed window that the next entry pools together with its own tokens."""

    rate: int  # m: tokens per window
    overlapping: bool  # CSA-style: entry i also pools the second half of window i-1
    entries: torch.Tensor  # [B, n, D]: entry i pools window i, tokens [i*m, (i+1)*m) (+ overlap)
    tail_kv: torch.Tensor  # [B, r, C]: projections of the r < m tokens of the open window
    tail_gate: torch.Tensor  # [B, r, C]: their gate logits (position bias not yet added)
    overlap_kv: torch.Tensor | None = None  # [B, m, D]
    overlap_gate: torch.Tensor | None = None  # [B, m, D] (position bias added)

    @property
    def count(self) -> int:
        return self.entries.shape[1]

    def nbytes(self) -> int:
        return sum(_nbytes(p) for p in (self.entries, self.tail_kv, self.tail_gate, self.overlap_kv, self.overlap_gate))

    def objects(self, layer: int, seq_len: int, prefix: str = "") -> list[StateObject]:
        m, n = self.rate, self.count
        span = 2 * m if self.overlapping else m
        out = [
            StateObject(layer, prefix + ("keys" if prefix else "compressed"), tuple(self.entries.shape), True,
                        (0, n * m), _nbytes(self.entries), n, m, span, 0),
            StateObject(layer, prefix + "tail", (2, *self.tail_kv.shape), True, (n * m, n * m + self.tail_kv.shape[1]),
                        _nbytes(self.tail_kv) + _nbytes(self.tail_gate), self.tail_kv.shape[1], 1, 1, n * m),
        ]
        if self.overlapping and self.overlap_kv is not None:
            out.append(StateObject(layer, prefix + "overlap", (2, *self.overlap_kv.shape), True, ((n - 1) * m, n * m),
                                   _nbytes(self.overlap_kv) + _nbytes(self.overlap_gate), m, 1, 1, (n - 1) * m))
        return out

    def export(self, lo: int, hi: int, snapshots: bool = True, prefix: str = "") -> dict[str, Piece]:
        m = self.rate
        out = {prefix + ("keys" if prefix else "compressed"): Piece(True, self.entries[:, lo // m: hi // m].clone())}
        if not snapshots:
            return out
        out[prefix + "tail"] = Piece(False, (self.tail_kv.clone(), self.tail_gate.clone()))
        if self.overlapping:
            # before the first window closes there is no overlap: stored as zero-length slices, so a
            # piece is never None and a buffer check always has a shape and dtype to hold it to
            empty = self.entries[:, :0]
            pair = (self.overlap_kv, self.overlap_gate) if self.overlap_kv is not None else (empty, empty)
            out[prefix + "overlap"] = Piece(False, _clone(pair))
        return out

    def for_replay(self, pieces: dict[str, object], prefix: str = "") -> CompressedState:
        """Every cached entry, exact; the tail and overlap empty, for a replay to rebuild."""
        entries = torch.cat([self.entries, *pieces[prefix + ("keys" if prefix else "compressed")]], dim=1)
        return CompressedState(self.rate, self.overlapping, entries, self.tail_kv[:, :0].clone(),
                               self.tail_gate[:, :0].clone())

    def assemble(self, seq_len: int, pieces: dict[str, object], prefix: str = "") -> CompressedState:
        entries = torch.cat([self.entries, *pieces[prefix + ("keys" if prefix else "compressed")]], dim=1)
        tail_kv, tail_gate = _clone(pieces[prefix + "tail"])
        overlap = _clone(pieces.get(prefix + "overlap")) or (None, None)
        if overlap[0] is not None and overlap[0].shape[1] == 0:
            overlap = (None, None)
        return CompressedState(self.rate, self.overlapping, entries, tail_kv, tail_gate, *overlap)


@dataclass
class V4AttnState:
    """One DeepSeek-V4 attention layer: the sliding window, plus a compressor (CSA / HCA) and, for
    CSA, the lightning indexer's own compressed keys."""

    window: WindowState
    compressor: CompressedState | None = None
    indexer: CompressedState | None = None
    # Tail-Replay: while positions before replay_end run again, the compressed entries (exact,
    # from the cache) are read, never appended; the window, tails and overlaps are rebuilt
    replay_end: int | None = None

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in (self.window, self.compressor, self.indexer) if s is not None)

    def objects(self, layer: int, seq_len: int) -> list[StateObject]:
        out = self.window.objects(layer, seq_len)
        if self.compressor is not None:
            out += self.compressor.objects(layer, seq_len)
        if self.indexer is not None:
            out += self.indexer.objects(layer, seq_len, prefix="index_")
        return out

    def export(self, lo: int, hi: int, snapshots: bool = True) -> dict[str, Piece]:
        out = self.window.export(lo, hi, snapshots)
        if self.compressor is not None:
            out |= self.compressor.export(lo, hi, snapshots)
        if self.indexer is not None:
            out |= self.indexer.export(lo, hi, snapshots, prefix="index_")
        return out

    def for_replay(self, begin: int, end: int, pieces: dict[str, object]) -> V4AttnState:
        """The state a Tail-Replay of [begin, end) starts from: every compressed entry of [0, end)
        exact from the cache; an empty window at `begin`; tails and overlaps empty. The replay
        rebuilds the snapshot parts from the tokens it runs (validation.REBUILT_BY_REPLAY)."""
        return V4AttnState(
            WindowState(self.window.kv[:, :0].clone(), begin),
            self.compressor.for_replay(pieces) if self.compressor is not None else None,
            self.indexer.for_replay(pieces, prefix="index_") if self.indexer is not None else None,
            replay_end=end,
        )

    def assemble(self, seq_len: int, pieces: dict[str, object]) -> V4AttnState:
        return V4AttnState(
            self.window.assemble(seq_len, pieces),
            self.compressor.assemble(seq_len, pieces) if self.compressor is not None else None,
            self.indexer.assemble(seq_len, pieces, prefix="index_") if self.indexer is not None else None,
        )

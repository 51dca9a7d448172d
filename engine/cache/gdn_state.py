"""Gated DeltaNet's state: the conv window and the recurrent matrix per head, which describe the
whole prefix and cannot be cut back to a token; the decay statistics Tail-Replay's bound needs, and
the int8 sketches an approximate replay may restart from."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from engine.cache.states import Kind, Piece, StateObject, per_token, tensor_bytes
from kernels.native import decay_scan


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
    # boundary snapshots inside a forward pass (the prefix cache's checkpoints, without stopping
    # the prefill there): the positions the next forward keeps (recurrent, conv) at, and those kept
    marks: tuple[int, ...] = ()
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    snapshots_inside: ClassVar[bool] = True

    def mark(self, positions: tuple[int, ...]) -> None:
        """Keep the state at these positions during the next forward pass (what was kept before is
        dropped)."""
        self.marks, self.kept = tuple(positions), {}

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
        rows = self._stats_rows(g.shape[1])
        if g.shape[1] > 1 and decay_scan.applies(g, x, self.norm, rows):  # the recurrence as a plain scan in C
            self.norm = decay_scan.decay_scan(g, x, self.norm, rows, 1 + 1e-6)
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
        rows[..., 0] = g
        rows[..., 1] = n.float()
        self.norm = n[:, -1]

    @staticmethod
    def record_rows(states: list[GDNState], starts: list[int], g: torch.Tensor, x: torch.Tensor) -> None:
        """record() for one decode token of each of N sequences (g, x: [N, 1, Hv]; row i states[i]'s
        at starts[i]): the recurrence once for all the rows that record, each row's result its own."""
        rows = [i for i, (s, p) in enumerate(zip(states, starts)) if s.tracking and not s.static and p == s.stats_end]
        if not rows:
            return
        if len(rows) < len(states):
            pick = torch.tensor(rows, device=g.device)
            g, x = g[pick], x[pick]
        norms = torch.cat([states[i].norm for i in rows])  # [M, Hv] float64
        n = (torch.exp(g[:, 0].double()) * norms + x[:, 0].double()) * (1 + 1e-6)
        stats = torch.stack((g[:, 0], n.float()), dim=-1).unsqueeze(1).unbind(0)  # M x [1, Hv, 2]
        for state_stats, norm, i in zip(stats, n.split(1), rows):
            state = states[i]
            state._stats_rows(1).copy_(state_stats.unsqueeze(0))
            state.norm = norm

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
        """Segments are exported in order, once: what precedes the last export is not needed again.
        A view, not a copy: the rows after it keep their room to grow into, and the next growth
        (`_stats_rows`) copies only the rows still used."""
        if pos > self.stats_start:
            self.stats = self.stats[:, pos - self.stats_start:]
            self.stats_start = pos

    def nbytes(self) -> int:
        return tensor_bytes(self.conv) + tensor_bytes(self.recurrent) + tensor_bytes(self.stats)

    def objects(self, layer: int, seq_len: int) -> list[StateObject]:
        held = self.conv.shape[-1]
        used = self.stats[:, :self.stats_end - self.stats_start]
        return [
            StateObject(layer, Kind.RECURRENT, tuple(self.recurrent.shape), False, (0, seq_len), tensor_bytes(self.recurrent)),
            # the conv window is the last K-1 inputs, but it only means something at exactly seq_len
            StateObject(layer, Kind.CONV, tuple(self.conv.shape), False, (max(0, seq_len - held), seq_len),
                        tensor_bytes(self.conv)),
            per_token(layer, Kind.DECAY, used, self.stats_start),
        ]

    def export(self, lo: int, hi: int, snapshots: bool = True, sketches: bool = False) -> dict[str, Piece]:
        """`sketches`: an int8 sketch of the recurrent state at hi too (a snapshot: needs the
        state at hi), which only seeds an approximate replay. Snapshots describe hi: the state's
        own position, or one the last forward pass was asked to keep (`mark`)."""
        out = {}
        if self.stats_start <= lo and hi <= self.stats_end:
            # per group of `stride` tokens: the summed log-decay and N at the group's end, which is
            # all a bound at the group boundaries needs (16x smaller than per token)
            n = hi - lo
            stride = math.gcd(STAT_STRIDE, n) if n else 1
            seg = self.stats[:, lo - self.stats_start:hi - self.stats_start]
            seg = seg.reshape(seg.shape[0], n // stride, stride, *seg.shape[2:])
            out[Kind.DECAY] = Piece(True, torch.stack([seg[..., 0].sum(2), seg[:, :, -1, :, 1]], dim=-1), hi)
            self._forget_stats_before(hi)
        return self._snapshots(out, hi, snapshots, sketches)

    def _snapshots(self, out: dict[str, Piece], hi: int, snapshots: bool, sketches: bool) -> dict[str, Piece]:
        """`out` with the snapshots at hi: kept inside the last pass (tensors nothing else holds or
        writes: no copy needed), or the state's own (copied: the state goes on)."""
        kept = self.kept.get(hi)
        if snapshots:
            recurrent, conv = kept if kept is not None else (self.recurrent.clone(), self.conv.clone())
            out[Kind.RECURRENT] = Piece(False, recurrent, hi)
            out[Kind.CONV] = Piece(False, conv, hi)
        if sketches:
            out[Kind.SKETCH] = Piece(False, sketch(kept[0] if kept is not None else self.recurrent), hi)
        return out

    def export_segments(self, bounds: list[tuple[int, int]], snapshots: list[bool],
                        sketches: list[bool]) -> list[dict[str, Piece]]:
        """export() for consecutive segments of one length (`bounds`, ascending): the same pieces,
        with the decay statistics of the whole run summed in one pass instead of per segment."""
        lengths = {hi - lo for lo, hi in bounds}
        lo, hi = bounds[0][0], bounds[-1][1]
        if len(bounds) == 1 or len(lengths) != 1 or not (self.stats_start <= lo and hi <= self.stats_end):
            return [self.export(a, z, s, k) for (a, z), s, k in zip(bounds, snapshots, sketches)]
        n = lengths.pop()
        stride = math.gcd(STAT_STRIDE, n) if n else 1
        run = self.stats[:, lo - self.stats_start:hi - self.stats_start]
        run = run.reshape(run.shape[0], len(bounds), n // stride, stride, *run.shape[2:])
        # [segments, B, n // stride, Hv, 2], each segment's rows contiguous as export() makes them
        decay = torch.stack([run[..., 0].sum(3), run[:, :, :, -1, :, 1]], dim=-1).transpose(0, 1).contiguous()
        self._forget_stats_before(hi)
        return [self._snapshots({Kind.DECAY: Piece(True, d, z)}, z, s, k)
                for d, (_, z), s, k in zip(decay.unbind(0), bounds, snapshots, sketches)]

    def assemble(self, seq_len: int, pieces: dict[str, object]) -> GDNState:
        state = GDNState(conv=pieces[Kind.CONV].clone(), recurrent=pieces[Kind.RECURRENT].clone())
        state.resume_stats(seq_len, pieces.get(Kind.DECAY))
        return state

"""Tail-Replay policy and its certificate.

A GDN layer's state at P is S_P. Replaying tokens [s, P) from a zero state (with the same
inputs) leaves an error E_P = S_s * prod_{t=s}^{P-1} exp(g_t) (I - beta_t k_t k_t^T), and since
k is unit-norm and 0 < beta < 1, |E_P|_F <= |S_s|_F * exp(sum_{t=s}^{P-1} g_t) <= N_{s-1} *
exp(sum g), with N the norm bound every GDNState records per token (gdn_state.GDNState.record). So
from the cached per-token (g_t, N_t) of a prefix, the error of every possible replay start is
known before replaying: `bounds`. The certificate is exact for the first GDN layer (its inputs
are the exact embeddings and attention outputs over exact KV); deeper GDN layers see inputs that
the replay itself approximates, so for them it bounds the dropped contribution given their inputs.

The conv state (the last K-1 inputs) is rebuilt by starting the model K-1 tokens before the
earliest recurrent reset: `warmup`.

A restart from an int8 sketch of S_p (gdn_state.sketch) instead of zero leaves E = (S_p - sketch) *
prod(...), so |E|_F <= err_p * exp(sum g), err_p the sketch's exact error: `Seeds`. The same
caveat holds, and matters more because the bound is tight: it certifies the first GDN layer;
deeper layers see inputs that the layers below perturb (after p by their sketch errors; before p
the warm-up tokens run them from zero, so their conv states at p come from approximate
activations), and their measured errors can exceed their bound a few-fold. Storing the conv
state beside the sketch and starting at p without a warm-up would remove the second part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ReplayPolicy:
    """exact: resume at the nearest earlier checkpoint and recompute from there, or (the
    validator decides, by `CacheConfig.exact_replay_cost`) replay the whole match from its start,
    which is exact too. approximate
    (Tail-Replay): replay at most `budget` tokens (a fraction of the matched prefix if < 1, else
    a token count; None: no cap) from a zero state; with `tolerance`, the shortest replay whose
    certified bound is below it in every GDN layer (adaptive). An exact checkpoint inside the
    window is always used instead."""

    mode: str = "exact"  # exact | approximate
    budget: float | None = 0.05
    tolerance: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("exact", "approximate"):
            raise ValueError(f"replay mode must be exact or approximate, got {self.mode!r}")
        if self.budget is not None and self.budget <= 0:
            raise ValueError("the replay budget must be > 0 (a fraction < 1, or tokens >= 1)")
        if self.tolerance is not None and self.tolerance <= 0:
            raise ValueError("the replay tolerance must be > 0")
        if self.mode == "approximate" and self.budget is None and self.tolerance is None:
            raise ValueError("approximate replay needs a budget, a tolerance, or both")

    @property
    def adaptive(self) -> bool:
        return self.tolerance is not None

    def earliest_restart(self, prefix: int, warmup: int) -> int:
        """The earliest position a replay of a `prefix`-token match may restart its recurrent
        states at: its `warmup` tokens before that (the conv states) must fit the budget too."""
        cap = self.tokens(prefix)
        return 0 if cap is None else max(0, prefix - cap + warmup)

    def tokens(self, prefix: int) -> int | None:
        """The most tokens a replay of a `prefix`-token match may take (None: no cap)."""
        if self.budget is None:
            return None
        return int(self.budget * prefix) if self.budget < 1 else int(self.budget)


def _suffix(decay: torch.Tensor) -> torch.Tensor:
    """[B, G + 1, H]: the summed log-decay from each group boundary to the end (0 at G)."""
    g = decay[..., 0].double()
    out = torch.zeros(g.shape[0], g.shape[1] + 1, g.shape[2], dtype=torch.float64, device=g.device)
    out[:, :g.shape[1]] = g.flip(1).cumsum(1).flip(1)
    return out


def bounds(decay: torch.Tensor) -> torch.Tensor:
    """decay: [B, G, H, 2] per group of tokens (summed log-decay, N at the group's end) of one GDN
    layer (a group may be one token). Returns [G + 1]: for a replay starting at each group
    boundary i, the bound on the error of that layer's state at the end (max over batch and
    heads); bounds[0] = 0 (replaying everything from zero is exact), bounds[G] = N at the end (no
    replay)."""
    n = decay[..., 1].double()
    before = torch.cat([torch.zeros_like(n[:, :1]), n], dim=1)  # N_{s-1}, with N_{-1} = 0
    out = torch.nan_to_num(before * torch.exp(_suffix(decay)), nan=float("inf"))  # an unknown norm (inf) stays unknown
    return out.amax(dim=(0, 2)) * (1 + 1e-6)


@dataclass(frozen=True)
class Seeds:
    """Int8 sketches of the GDN states at some boundaries (gdn_state.sketch): a replay may restart
    there from the sketch instead of zero, and its error at the end is then bounded by the
    sketch's exact error times the same decay product."""

    positions: tuple[int, ...]  # token positions (multiples of the statistics' stride), ascending
    errors: dict[int, torch.Tensor]  # per GDN layer [B, len(positions), H]: |S - sketch|_F


def _seeded_bounds(decay: torch.Tensor, errors: torch.Tensor, groups: list[int]) -> torch.Tensor:
    """[len(groups)]: the bound of a replay restarting from the sketches at those group boundaries."""
    out = errors.double() * torch.exp(_suffix(decay)[:, groups])
    return torch.nan_to_num(out, nan=float("inf")).amax(dim=(0, 2)) * (1 + 1e-6)


@dataclass(frozen=True)
class ReplayChoice:
    begin: int  # the replay runs the model over [begin, end)
    end: int
    starts: tuple[tuple[int, int], ...]  # (layer, position where its recurrent state restarts)
    bounds: tuple[tuple[int, float], ...]  # (layer, certified error bound of its state at end)
    seeded: tuple[int, ...] = ()  # layers that restart from their sketch at `seed` instead of zero
    seed: int | None = None

    @property
    def bound(self) -> float:
        return max((b for _, b in self.bounds), default=0.0)


def choose(policy: ReplayPolicy, end: int, layer_decay: dict[int, torch.Tensor], warmup: int,
           stride: int = 1, seeds: Seeds | None = None) -> ReplayChoice | None:
    """The replay for a prefix of `end` tokens whose GDN layers recorded `layer_decay` (one
    statistic per `stride` tokens), or None when the policy allows none (the budget cannot even
    rebuild the conv state, or no start within it meets the tolerance: the exact plan applies).

    Candidate starts: every group boundary (the recurrent states restart from zero) and every
    boundary in `seeds` (each layer restarts from its sketch where that bounds its error lower);
    each begins `warmup` tokens earlier, which rebuild the conv states. A fixed budget takes the
    start within it whose bound is lowest (ties: the longer replay, as the budget allows);
    adaptive the latest start whose bound is within the tolerance in every layer."""
    cap = policy.tokens(end)
    layers = sorted(layer_decay)
    if not layers:
        return None
    zero = torch.stack([bounds(layer_decay[layer]) for layer in layers])  # [L, G + 1]
    lowest = policy.earliest_restart(end, warmup)
    first = -(-lowest // stride)
    # candidates: (position, bound over layers, per-layer bounds, layers restarting from a sketch)
    worst = zero[:, first:].amax(0).tolist()
    candidates = [(g * stride, bound, None, ()) for g, bound in enumerate(worst, first)]
    if seeds is not None:
        at = [i for i, p in enumerate(seeds.positions) if lowest <= p <= end]
        if at:
            g_at = [seeds.positions[i] // stride for i in at]
            seeded = torch.stack([_seeded_bounds(layer_decay[layer], seeds.errors[layer][:, at], g_at) for layer in layers])
            best = torch.minimum(seeded, zero[:, g_at])  # per layer the lower of sketch and zero
            use = (seeded < zero[:, g_at]).T.tolist()
            for n, (per, bound) in enumerate(zip(best.T.tolist(), best.amax(0).tolist())):
                chosen = tuple(layer for layer, u in zip(layers, use[n]) if u)
                if chosen:
                    candidates.append((seeds.positions[at[n]], bound, per, chosen))
    if policy.adaptive:
        pick = max((c for c in candidates if c[1] <= policy.tolerance), key=lambda c: (c[0], -c[1]), default=None)
    else:
        pick = min(candidates, key=lambda c: (c[1], c[0]), default=None)
    if pick is None:
        return None
    position, _, per, use = pick
    if per is None:
        per = zero[:, position // stride].tolist()
    begin = max(0, position - warmup)
    if cap is not None and end - begin > cap:
        return None
    return ReplayChoice(begin, end, tuple((layer, position) for layer in layers),
                        tuple(zip(layers, per)), use, position if use else None)

"""Tail-Replay policy and its certificate.

A GDN layer's state at P is S_P. Replaying tokens [s, P) from a zero state (with the same
inputs) leaves an error E_P = S_s * prod_{t=s}^{P-1} exp(g_t) (I - beta_t k_t k_t^T), and since
k is unit-norm and 0 < beta < 1, |E_P|_F <= |S_s|_F * exp(sum_{t=s}^{P-1} g_t) <= N_{s-1} *
exp(sum g), with N the norm bound every GDNState records per token (states.GDNState.record). So
from the cached per-token (g_t, N_t) of a prefix, the error of every possible replay start is
known before replaying: `bounds`. The certificate is exact for the first GDN layer (its inputs
are the exact embeddings and attention outputs over exact KV); deeper GDN layers see inputs that
the replay itself approximates, so for them it bounds the dropped contribution given their inputs.

The conv state (the last K-1 inputs) is rebuilt by starting the model K-1 tokens before the
earliest recurrent reset: `warmup`.
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

    def tokens(self, prefix: int) -> int | None:
        """The most tokens a replay of a `prefix`-token match may take (None: no cap)."""
        if self.budget is None:
            return None
        return int(self.budget * prefix) if self.budget < 1 else int(self.budget)


def bounds(decay: torch.Tensor) -> torch.Tensor:
    """decay: [B, G, H, 2] per group of tokens (summed log-decay, N at the group's end) of one GDN
    layer (a group may be one token). Returns [G + 1]: for a replay starting at each group
    boundary i, the bound on the error of that layer's state at the end (max over batch and
    heads); bounds[0] = 0 (replaying everything from zero is exact), bounds[G] = N at the end (no
    replay)."""
    g, n = decay[..., 0].double(), decay[..., 1].double()
    p = g.shape[1]
    # suffix[s] = sum_{t >= s} g_t, for s in 0..P
    suffix = torch.zeros(g.shape[0], p + 1, g.shape[2], dtype=torch.float64, device=g.device)
    suffix[:, :p] = g.flip(1).cumsum(1).flip(1)
    before = torch.cat([torch.zeros_like(n[:, :1]), n], dim=1)  # N_{s-1}, with N_{-1} = 0
    out = torch.nan_to_num(before * torch.exp(suffix), nan=float("inf"))  # an unknown norm (inf) stays unknown
    return out.amax(dim=(0, 2)) * (1 + 1e-6)


@dataclass(frozen=True)
class ReplayChoice:
    begin: int  # the replay runs the model over [begin, end)
    end: int
    starts: tuple[tuple[int, int], ...]  # (layer, position where its recurrent state restarts from zero)
    bounds: tuple[tuple[int, float], ...]  # (layer, certified error bound of its state at end)

    @property
    def bound(self) -> float:
        return max((b for _, b in self.bounds), default=0.0)


def choose(policy: ReplayPolicy, end: int, layer_decay: dict[int, torch.Tensor], warmup: int,
           stride: int = 1) -> ReplayChoice | None:
    """The replay for a prefix of `end` tokens whose GDN layers recorded `layer_decay` (one
    statistic per `stride` tokens), or None when the policy allows none (the budget cannot even
    rebuild the conv state, or no start within it meets the tolerance: the exact plan applies).
    Restarts fall on multiples of `stride`."""
    cap = policy.tokens(end)
    per_layer = {layer: bounds(d) for layer, d in layer_decay.items()}
    if policy.adaptive:
        # per layer the latest start (shortest replay) whose bound is within tolerance (start 0
        # always is); the model runs from the earliest of them for every layer anyway, and a
        # bound never grows as the start moves earlier, so every layer restarts there
        first = min((int(torch.nonzero(b <= policy.tolerance).max()) for b in per_layer.values()), default=end // stride)
    else:
        first = -(-max(0, end - cap + warmup) // stride)  # the first group boundary inside the budget
        if first * stride > end:
            return None
    groups = {layer: first for layer in per_layer}
    begin = max(0, first * stride - warmup)
    if cap is not None and end - begin > cap:
        return None
    return ReplayChoice(begin, end, tuple((layer, g * stride) for layer, g in sorted(groups.items())),
                        tuple((layer, float(per_layer[layer][g])) for layer, g in sorted(groups.items())))

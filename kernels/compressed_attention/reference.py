"""Pure-torch DeepSeek-V4 attention over a sliding window and compressed entries: the reference
the Triton kernel is tested against, and the CPU path (what V4Attention runs).

    q          [B, Tq, H, D]     queries at positions q_start .. q_start + Tq - 1
    keys       [B, Kw, D]        the window's keys (K = V: they are also the values) at positions
                                 key_start ..; they cover (q_pos - window, q_pos] for every query
    entries    [B, n, D] | None  compressed entries (K = V), entry i closes at position (i + 1)·rate - 1:
                                 a query at p sees entries i < (p + 1) // rate
    selected   [B, Tq, k] | None CSA: the indexer's top-k entry ids per query (-1: none; distinct);
                                 None: every visible entry (HCA)
    sink       [H] float32       a per-head logit in the softmax's denominator with no value
    -> out     [B, Tq, H, D] in q's dtype
"""

from __future__ import annotations

import torch


def attend(q, q_start: int, keys, key_start: int, window: int, entries, rate: int, selected, sink, scale: float):
    t = q.shape[1]
    q_pos = torch.arange(q_start, q_start + t, device=q.device)
    lo_pos = max(q_start - window + 1, key_start)
    k = keys[:, lo_pos - key_start: q_start + t - key_start]  # [B, Kw, D]
    k_pos = torch.arange(lo_pos, lo_pos + k.shape[1], device=q.device)
    # keys (t - W, t]
    allowed = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
    logits = torch.einsum("bqhd,bkd->bhqk", q, k) * scale
    logits = logits.masked_fill(~allowed, float("-inf"))
    values = [k]
    if entries is not None and entries.shape[1]:
        n_vis = min((q_start + t) // rate, entries.shape[1])
        e = entries[:, :n_vis]
        visible = torch.arange(n_vis, device=q.device)[None, :] < ((q_pos + 1) // rate)[:, None]
        vis = visible[None].expand(q.shape[0], -1, -1)  # [B, Tq, n]
        if selected is not None:
            chosen = torch.zeros(q.shape[0], t, n_vis + 1, dtype=torch.bool, device=q.device)
            idx = torch.where(selected >= 0, selected.clamp(max=n_vis), n_vis)
            chosen.scatter_(-1, idx, True)
            vis = vis & chosen[..., :n_vis]
        e_logits = torch.einsum("bqhd,bkd->bhqk", q, e) * scale
        logits = torch.cat([logits, e_logits.masked_fill(~vis[:, None], float("-inf"))], dim=-1)
        values.append(e)
    sink = sink.float().view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
    logits = torch.cat([logits.float(), sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1].to(q.dtype)
    v = torch.cat(values, dim=1)  # [B, K, D]
    return torch.einsum("bhqk,bkd->bqhd", probs, v)


def attend_rows(q, kv, lengths, sink, scale: float):
    """One decode query per row, each over keys of its own (a batched decode step of independent
    sequences): q [N, H, D]; kv [N, K, D] (K = V), row i's first lengths[i] vectors the keys its
    query sees (the window's, then the visible or chosen compressed entries), the rest padding;
    sink [H] float32 -> [N, H, D] in q's dtype. `attend`'s arithmetic over the same keys, gathered
    instead of masked: equal to it up to float32 summation order."""
    logits = torch.einsum("nhd,nkd->nhk", q, kv) * scale
    padding = torch.arange(kv.shape[1], device=q.device)[None, :] >= lengths[:, None]  # [N, K]
    logits = logits.masked_fill(padding[:, None], float("-inf"))
    sink = sink.float().view(1, -1, 1).expand(*logits.shape[:2], 1)
    logits = torch.cat([logits.float(), sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1].to(q.dtype)
    return torch.einsum("nhk,nkd->nhd", probs, kv)

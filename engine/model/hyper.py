"""Manifold-constrained hyper-connections (DeepSeek-V4): the residual is N parallel streams.

Before a sub-block, the streams are collapsed with weights `pre` into its input; after it, its
output is spread back with weights `post`, and the old streams are mixed by `comb`, a matrix
pushed towards doubly-stochastic by Sinkhorn iterations so the mix cannot grow the signal:

    streams' = post[n] * f(sum_n pre[n] * streams[n]) + comb^T @ streams      [B, T, N, D]

All three weights come from one linear map of the RMS-normalised, flattened streams.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.direct import linear


def _flat_unit_rms(streams: torch.Tensor, eps: float) -> torch.Tensor:
    flat = streams.flatten(2).float()
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.hc_mult
        self.n, self.iters, self.hc_eps, self.eps = n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B, T, N, D] -> (collapsed input [B, T, D], post [B, T, N], comb [B, T, N, N])."""
        n = self.n
        mixes = linear(_flat_unit_rms(streams, self.eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * s_comb + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return collapsed, post, comb

    @staticmethod
    def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ streams


class HyperHead(nn.Module):
    """Collapses the streams once more before the final norm (weights from the streams, no mix)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.hc_mult
        self.hc_eps, self.eps = cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros(n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros(n))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = linear(_flat_unit_rms(streams, self.eps), self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)

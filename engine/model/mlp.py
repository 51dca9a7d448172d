"""Feed-forward blocks: dense SwiGLU and the Qwen3-Next mixture of experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.model.direct import Direct, Linear, linear
from engine.model.fused import FusedLinear


class MLP(Direct, nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = FusedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate})
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward_split(x)
        if gate.requires_grad:
            return self.down_proj(F.silu(gate) * up)
        # in the projection's own buffer: at prefill sizes two fresh [T, I] activations cost more
        # (page faults included) than the arithmetic; the down projection reads the strided view
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class Experts(nn.Module):
    """E SwiGLU experts stored stacked: gate_up [E, 2I, H], down [E, H, I]."""

    def __init__(self, n: int, hidden: int, intermediate: int, limit: float | None = None):
        super().__init__()
        self.limit = limit
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(n, hidden, intermediate))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [N, H]; idx, weight [N, k]: each token's experts and their mixing weights."""
        out = torch.zeros_like(x)
        flat = idx.flatten()
        order = flat.argsort()
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        token_of = order // idx.shape[1]
        w_sorted = weight.flatten()[order]
        lo = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[lo:lo + n]
            gate, up = linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = linear(_clamped_swiglu(gate, up, self.limit), self.down_proj[e]) * w_sorted[lo:lo + n, None].to(x.dtype)
            out.index_add_(0, tok, y)
            lo += n
        return out


class SparseMoE(nn.Module):
    """Softmax router over E experts, top-k (optionally renormalised), plus a sigmoid-gated shared expert."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk = cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.gate(flat).float(), dim=-1)
        top_w, top_i = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        routed = self.experts(flat, top_i, top_w.to(x.dtype))
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (routed + shared).reshape(shape)


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class ClampedMLP(nn.Module):
    """DeepSeek-V4 shared expert: SwiGLU with gate and up clamped to the swiglu limit."""

    def __init__(self, hidden: int, intermediate: int, limit: float | None):
        super().__init__()
        self.limit = limit
        self.w13 = FusedLinear(hidden, {"w1": intermediate, "w3": intermediate})
        self.w2 = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13.forward_split(x)
        return self.w2(_clamped_swiglu(gate, up, self.limit))


class Router(nn.Module):
    """DeepSeek-V4 routing: scores = f(logits) (sqrt-softplus, sigmoid or softmax); experts picked
    by top-k of scores + a correction bias, or, in hash layers, by a fixed token-id table; weights
    are the picked scores renormalised and scaled."""

    def __init__(self, cfg: ModelConfig, hashed: bool):
        super().__init__()
        self.top_k, self.scale, self.func = cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.scoring_func
        self.hashed = hashed
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.num_experts))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x, self.weight)
        if self.func == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.func == "sigmoid":
            scores = torch.sigmoid(logits)
        else:
            scores = torch.softmax(logits, dim=-1)
        if self.hashed:
            idx = self.tid2eid[ids.reshape(-1)]
        else:
            idx = (scores + self.bias).topk(self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        return idx, w / (w.sum(-1, keepdim=True) + 1e-20) * self.scale


class V4MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__()
        self.gate = Router(cfg, hashed=cfg.mlp_layer_types[idx] == "hash_moe")
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit)
        self.shared_experts = ClampedMLP(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, w = self.gate(flat, ids)
        return self.experts(flat, idx, w).reshape(shape) + self.shared_experts(x)

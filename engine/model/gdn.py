"""Gated DeltaNet token mixer (Qwen3.5 / Qwen3-Next linear_attention layers).

x -> in_proj (qkv | z | b | a) -> qkv: causal depthwise conv (kernel K) + silu -> q, k (L2-normalised), v
  -> gated delta rule with decay g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b)
  -> GatedRMSNorm(out, z) -> out_proj

All of the layer's memory of the sequence is in a GDNState passed in by the caller.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.cache.gdn_state import GDNState
from engine.config import ModelConfig
from engine.model.derived import derived
from engine.model.direct import Linear
from engine.model.fused import FusedLinear
from engine.model.norm import GatedRMSNorm, as_dtype, as_float, constant, normalized
from kernels.gated_delta import chunk_gated_delta, chunk_gated_delta_at, recurrent_gated_delta
from kernels.native import gdn_decode as native_decode

L2_EPS = 1e-6  # inside the root, as the Gated DeltaNet checkpoints were trained with


class GatedDeltaNet(nn.Module):
    kind = "linear_attention"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_k = cfg.linear_num_key_heads
        self.n_v = cfg.linear_num_value_heads
        self.dk = cfg.linear_key_head_dim
        self.dv = cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        key_dim, value_dim = self.n_k * self.dk, self.n_v * self.dv
        self.conv_dim = 2 * key_dim + value_dim
        h = cfg.hidden_size
        self.in_proj = FusedLinear(h, {"in_proj_qkv": self.conv_dim, "in_proj_z": value_dim,
                                       "in_proj_b": self.n_v, "in_proj_a": self.n_v})
        # depthwise: one K-tap filter per channel, stored as checkpoints do: [C, 1, K]
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.zeros(self.n_v))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(value_dim, h, bias=False)

    def new_state(self, batch: int, dtype, device) -> GDNState:
        return GDNState.zeros(batch, self.conv_dim, self.kernel, self.n_v, self.dk, self.dv, dtype, device)

    def forward(self, x: torch.Tensor, state: GDNState | None, start: int = 0) -> torch.Tensor:
        return self.output(self.core(self.project(x), state, start))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, C + Hv*Dv + 2*Hv]: qkv | z | b | a, `core`'s input."""
        return self._modules["in_proj"](x)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """`core`'s output [B, T, Hv*Dv] -> [B, T, hidden]."""
        return self._modules["out_proj"](o)

    def core(self, proj: torch.Tensor, state: GDNState | None, start: int = 0) -> torch.Tensor:
        """Everything between the two projections, the only part that reads or advances `state`:
        so the rows of a batched decode step (engine/batch_decode.py) project together and run
        this each on its own state."""
        b, t, _ = proj.shape
        if t == 1 and state is not None and not state.static:
            if native_decode.applies(proj, state.conv, state.recurrent):
                return self._native_step(proj, state, start)
            if native_decode.applies_upcast(proj, state.conv, state.recurrent):  # a bf16 model's token
                return self._native_step(proj, state, start, upcast=True)
        qkv, z, b_in, a_in = self.in_proj.split(proj)
        # positions strictly inside this pass at which the cache wants the state (GDNState.mark)
        cuts = [p - start for p in state.marks if start < p < start + t] if state is not None and t > 1 else []
        history = state.conv if cuts else None  # the conv inputs before this pass, for the kept conv states
        mixed = self._conv(qkv, state)  # [B, T, C]
        qk, v = mixed.split([2 * self.n_k * self.dk, self.n_v * self.dv], -1)
        qk = _l2norm(qk.reshape(b, t, 2 * self.n_k, self.dk))  # q and k heads normalised in one pass
        q, k = qk[:, :, : self.n_k] * constant(self.dk ** -0.5, qk.dtype, qk.device), qk[:, :, self.n_k:]
        v = v.reshape(b, t, self.n_v, self.dv)
        beta = torch.sigmoid(b_in)
        g = self._neg_a() * F.softplus(as_float(a_in) + as_float(self.dt_bias))
        if state is not None and state.tracking:  # only a request the cache records pays for statistics
            state.record(start, g, beta.float() * v.float().norm(dim=-1))

        initial = None if state is None else state.recurrent
        if t == 1 and state is not None:
            o, final = recurrent_gated_delta(q, k, v, g, beta, initial)
        elif cuts:
            o, final, inner = chunk_gated_delta_at(q, k, v, g, beta, initial, cuts)
            self._keep(state, start, cuts, inner, history, qkv)
        else:
            o, final = chunk_gated_delta(q, k, v, g, beta, initial)
        if state is not None:
            if state.static:  # its buffers stay where a captured step reads and writes them
                state.recurrent.copy_(final)
            else:
                state.recurrent = final
        return self.norm(o, z.reshape(b, t, self.n_v, self.dv)).reshape(b, t, -1)

    def _keep(self, state: GDNState, start: int, cuts: list[int], inner: list[torch.Tensor],
              history: torch.Tensor, qkv: torch.Tensor) -> None:
        """The state after each cut as a pass ending there would leave it: the rule's state, and
        the conv window of the K-1 inputs before the cut (from before this pass, then this pass's),
        a copy of its own (a view would hold the pass's whole projection in the cache)."""
        w = self.kernel - 1
        for c, recurrent in zip(cuts, inner):
            rows = qkv[:, c - w:c] if c >= w else torch.cat([as_dtype(history[:, :, c:].transpose(1, 2), qkv.dtype),
                                                             qkv[:, :c]], dim=1)
            state.kept[start + c] = (recurrent, rows.transpose(1, 2).clone(memory_format=torch.contiguous_format))

    def _native_step(self, proj: torch.Tensor, state: GDNState, start: int, upcast: bool = False) -> torch.Tensor:
        """One decode token through kernels/native/gdn_decode.c: the same arithmetic as the torch
        path above in one call instead of ~50 ops; out_proj's input. `upcast` (a bf16 model): the
        kernel runs in float32 on float32 copies of the projected row, the conv window and the
        small parameters (kept, `derived`), and its output and window come back in bf16; the torch
        path would round after each of its ops instead."""
        # parameters and submodules through their dicts: nn.Module.__getattr__ costs ~0.4 us a name
        params, norm = self._parameters, self._modules["norm"]
        taps, dt_bias, norm_w = self._modules["conv1d"]._parameters["weight"], params["dt_bias"], norm._parameters["weight"]
        conv, low = state.conv, proj.dtype
        if upcast:
            proj, conv = proj.float(), conv.float()
            taps, dt_bias, norm_w = (derived(self, name, w, _float) for name, w in
                                     (("taps_f32", taps), ("dt_bias_f32", dt_bias), ("norm_f32", norm_w)))
        step = native_decode.decode_step(proj, conv, state.recurrent, taps, self._neg_a(), dt_bias, norm_w,
                                         self.n_k, L2_EPS, norm.eps, stats=state.tracking)
        state.conv, state.recurrent = (step.conv.to(low) if upcast else step.conv), step.recurrent
        if state.tracking:
            state.record(start, step.g, step.bv)
        out = step.out.view(proj.shape[0], 1, -1)
        return out.to(low) if upcast else out

    def core_rows(self, proj: torch.Tensor, states: list[GDNState], starts: list[int]) -> torch.Tensor | None:
        """`core` for a batched decode step (engine/model/rows.py): proj [N, 1, width], row i one
        token of the sequence whose state is states[i], at position starts[i] -> [N, 1, Hv*Dv],
        in one native call for every row, each row to the bit what its own `core` gives; None
        where the kernel does not take every row (each then runs `core`)."""
        if not all(not s.static and native_decode.applies(proj, s.conv, s.recurrent) for s in states):
            return None
        params, norm = self._parameters, self._modules["norm"]
        step = native_decode.decode_rows(
            proj, [s.conv for s in states], [s.recurrent for s in states],
            self._modules["conv1d"]._parameters["weight"], self._neg_a(), params["dt_bias"],
            norm._parameters["weight"], self.n_k, L2_EPS, norm.eps, stats=any(s.tracking for s in states))
        for i, state in enumerate(states):
            state.conv, state.recurrent = step.conv[i], step.recurrent[i]
        if step.g is not None:
            GDNState.record_rows(states, starts, step.g, step.bv)  # the decay statistics, once for all rows
        return step.out.view(len(states), 1, -1)

    def _neg_a(self) -> torch.Tensor:
        """-exp(A_log) in float32: the decay rate softplus(a + dt_bias) is scaled by."""
        return derived(self, "neg_a", self._parameters["A_log"], _neg_exp)

    def _conv(self, mixed: torch.Tensor, state: GDNState | None) -> torch.Tensor:
        """Causal depthwise conv + silu over [B, T, C]; the previous K-1 inputs come from state.

        Computed as K shifted multiply-adds in the token-major layout the projection produced:
        at these widths that is ~3x faster than conv1d, which needs channel-major copies both ways."""
        b, t, _ = mixed.shape
        k = self.kernel
        if t == 1 and state is not None:
            # decode: K products per channel, in the channel-major layout the state keeps
            full = torch.cat([as_dtype(state.conv, mixed.dtype), mixed.transpose(1, 2)], dim=-1)  # [B, C, K]
            if state.static:
                state.conv.copy_(full[:, :, 1:])
            else:
                state.conv = full[:, :, 1:]
            return F.silu((full * self.conv1d.weight[:, 0]).sum(-1)).unsqueeze(1)
        if state is None:
            history = mixed.new_zeros(b, k - 1, self.conv_dim)
        else:
            history = as_dtype(state.conv.transpose(1, 2), mixed.dtype)  # [B, K-1, C]
            tail = mixed[:, t - (k - 1):] if t >= k - 1 else torch.cat([history[:, t:], mixed], dim=1)
            state.conv = tail.transpose(1, 2).contiguous()  # stored channel-major: [B, C, K-1]
        # out_i = sum_j taps[j] * input_{i-(K-1)+j}, read straight from `mixed` (no [K-1+T, C]
        # concatenation to allocate); input rows before the chunk come from history
        taps = derived(self, "taps", self.conv1d.weight, lambda w: w[:, 0].t().contiguous())  # [K, C]
        out = mixed * taps[k - 1]
        for j in range(k - 1):
            back = min(k - 1 - j, t)  # leading rows whose tap-j input is in history
            out[:, back:].addcmul_(mixed[:, : t - back], taps[j])
            out[:, :back].addcmul_(history[:, j:j + back], taps[j])
        return F.silu(out, inplace=True)


def _neg_exp(a: torch.Tensor) -> torch.Tensor:
    return -a.float().exp()


def _l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return normalized(as_float(x), eps, mean=False)


def _float(w: torch.Tensor) -> torch.Tensor:
    return w.float().contiguous()

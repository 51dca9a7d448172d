"""Modules called as plain functions, and the one-row product split across threads (fp32) or
taken by the native kernel (bf16, kernels/native/gemv.c; int8 weights, kernels/native/gemv_q8.c).

`nn.Module.__call__` (hook dispatch, a few microseconds) is paid on every call, and a small
model's decode step makes ~90 of them: ~5% of the step here (measured against the same model
with every call going through it). Leaves and blocks, which nothing hooks, skip it: their
`__call__` is their `forward`. Token mixers keep the full call (tests hook them).
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels import q8
from kernels.q8 import reference as q8_reference
from kernels.native import gemv as native_gemv
from kernels.native import gemv_q8 as native_gemv_q8

# Weights below this many elements (256 KB in fp32) stay in the core's cache between decode steps
# and one thread reads them as fast as two; above it the split pays for its extra reduction.
SPLIT_MIN_ELEMENTS = 1 << 16
_MIN_PART_ROWS = 32
# A product of at least this many multiply-adds goes through oneDNN (below, its ~12 us per call
# costs more than it saves)
ONEDNN_MIN_MACS = 1 << 20
ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Direct:
    """Mixin: `module(x)` runs `module.forward(x)` with no hook dispatch."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__call__ = cls.forward


class Linear(Direct, nn.Linear):
    """`nn.Linear`, called directly.

    One row (a decode step) against a large fp32 weight stored [in, out] (the loader's CPU layout)
    is computed as `parts` partial products over slices of the input dimension, one per intra-op
    thread, summed: torch runs a one-row matmul on a single thread, which reads a weight that has
    left the cache at one core's bandwidth, while a batched matmul spreads its batch over the
    threads. The weight is not copied: [in, out] storage is already `parts` stacked [in/parts, out]
    blocks. Rounds differently from one matmul in the last bits (a sum of partial sums).

    With int8 weights (`quantise`: kernels/q8's format, engine/model/int8.py) the float weight is
    gone: one row takes the native int8 kernel, several rows the reference's product (a block of
    weight rows dequantised at a time, multiplied by `linear`), both in float32."""

    int8 = False  # the weight is held as `weight_q8` and `weight_scale` (quantise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8:
            q, scales, bias = self._buffers["weight_q8"], self._buffers["weight_scale"], self._parameters["bias"]
            if x.numel() == self.in_features and native_gemv_q8.applies(x, q, scales, bias):
                return native_gemv_q8.gemv_q8(x, q, scales, bias)
            return q8.linear(x, q, scales, bias, product=linear)
        if x.numel() == self.in_features and not torch.is_grad_enabled():
            w = self._parameters["weight"]
            # a bf16 weight: one C call reads it once at the memory's bandwidth over torch's
            # threads, where F.linear reads it at about half that (benchmarks/gemv.py)
            if w.dtype is torch.bfloat16 and x.dtype is torch.bfloat16:
                bias = self._parameters["bias"]
                if native_gemv.applies(x, w, bias):
                    return native_gemv.gemv(x, w, bias)
            blocks = self._split(torch.get_num_threads())
            if blocks is not None:
                y = torch.bmm(x.reshape(blocks.shape[0], 1, -1), blocks).sum(0)
                bias = self._parameters["bias"]
                if bias is not None:
                    y = y + bias
                return y.view(*x.shape[:-1], self.out_features)
        return linear(x, self.weight, self.bias)

    def quantise(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        """Hold the weight as int8 from now on: `q` int8 [out, in] and `scales` float32 [out,
        ceil(in / 32)] (kernels.q8.quantise of it); the float weight is dropped."""
        _hold_int8(self, q, scales, self.out_features, self.in_features)
        self.__dict__.pop("_split_held", None)

    def _apply(self, fn, recurse: bool = True):
        # .to(), .half(), .cuda() replace the weight: a held view would keep the old storage alive
        self.__dict__.pop("_split_held", None)
        return super()._apply(fn, recurse)

    def _split(self, threads: int) -> torch.Tensor | None:
        """The weight as [parts, in/parts, out] blocks for this many threads (a view, kept while
        the weight keeps its storage and the thread count stays), or None when the split does not
        apply. (Parameters are read from `_parameters`: `nn.Module.__getattr__` costs more than
        the check, on every projection of every decode step.)"""
        if threads < 2:
            return None
        w = self._parameters["weight"]
        held = self.__dict__.get("_split_held")
        if held is None or held[0] != threads or held[1] != w.data_ptr():
            held = self.__dict__["_split_held"] = (threads, w.data_ptr(), split_blocks(w, threads))
        return held[2]


class Embedding(Direct, nn.Embedding):
    """`nn.Embedding`, called directly; with int8 weights (`quantise`, a tied embedding under
    `--dtype int8`) the table is held as kernels/q8's int8 rows and scales only, the looked-up rows
    dequantised to float32, and the LM head takes the same two tensors (one table, q8_0's way)."""

    int8 = False  # the table is held as `weight_q8` and `weight_scale` (quantise)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.int8:
            flat = ids.reshape(-1)
            rows = q8.dequantise(self._buffers["weight_q8"].index_select(0, flat),
                                 self._buffers["weight_scale"].index_select(0, flat))
            return rows.view(*ids.shape, self.embedding_dim)
        return F.embedding(ids, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)

    def quantise(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        """Hold the table as int8 from now on (Linear.quantise's rule); the float table is dropped."""
        _hold_int8(self, q, scales, self.num_embeddings, self.embedding_dim)

    @property
    def held(self) -> torch.Tensor:
        """A tensor of the table as held (the int8 rows or the float weight): its device, and
        the model's dtype when it is float."""
        return self._buffers["weight_q8"] if self.int8 else self._parameters["weight"]


def _hold_int8(mod: nn.Module, q: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> None:
    """`mod.weight` [rows, cols] replaced by int8 `weight_q8` and float32 `weight_scale` buffers."""
    if tuple(q.shape) != (rows, cols) or q.dtype is not torch.int8:
        raise ValueError(f"quantise: int8 [{rows}, {cols}], not {q.dtype} {tuple(q.shape)}")
    if tuple(scales.shape) != (rows, q8.groups(cols)) or scales.dtype is not torch.float32:
        raise ValueError(f"quantise: float32 scales [{rows}, {q8.groups(cols)}], not {scales.dtype} {tuple(scales.shape)}")
    del mod.weight
    mod.register_buffer("weight_q8", q)
    mod.register_buffer("weight_scale", scales)
    mod.int8 = True


def split_blocks(w: torch.Tensor, threads: int) -> torch.Tensor | None:
    """[parts, in/parts, out] view of a CPU fp32 weight stored [in, out] (stride (1, out)), with
    parts the most threads that divide `in` into slices of at least 32 rows; None for a weight
    that is small, not stored [in, out], not fp32 or not on the CPU."""
    out_features, in_features = w.shape
    if (w.device.type != "cpu" or w.dtype != torch.float32 or w.numel() < SPLIT_MIN_ELEMENTS
            or not w.t().is_contiguous()):
        return None
    parts = next((p for p in range(threads, 1, -1)
                  if in_features % p == 0 and in_features // p >= _MIN_PART_ROWS), None)
    if parts is None:
        return None
    return w.detach().t().view(parts, in_features // parts, out_features)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; a CPU fp32 product of several rows, outside autograd, through oneDNN (one row
    stays with F.linear: oneDNN's fixed cost per call is more than a one-row product saves, and its
    bias must be contiguous).

    torch's CPU matmul is MKL's sgemm, which on AMD processors runs far below what the cores
    can do; oneDNN's inner product (the kernel torch's own compiler emits for CPU linears) runs
    AVX-512 there: [1024, 256] x [256, 1536] 3.7 -> 1.6 ms on 2 threads of this repo's CI
    machine (an AMD EPYC). Same fp32 arithmetic, a different summation order. oneDNN has no
    autograd, so training keeps F.linear. A bf16 product of at least UPCAST_MIN_ROWS rows on a CPU
    without bf16 hardware runs in fp32 too (`_upcast_linear`)."""
    if (ONEDNN and x.dtype is torch.float32 and w.dtype is torch.float32 and x.device.type == "cpu"
            and x.numel() != x.shape[-1] and x.numel() * w.shape[0] >= ONEDNN_MIN_MACS
            and (bias is None or bias.is_contiguous()) and not torch.is_grad_enabled()):
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    if (not BF16_GEMM and x.dtype is torch.bfloat16 and w.dtype is torch.bfloat16 and x.device.type == "cpu"
            and x.numel() >= UPCAST_MIN_ROWS * x.shape[-1] and not torch.is_grad_enabled()):
        return _upcast_linear(x, w, bias)
    return F.linear(x, w, bias)


def _bf16_gemm() -> bool:
    """Whether this CPU multiplies bf16 in hardware (x86: AVX-512 BF16 or AMX; Arm: the BF16
    extension), where oneDNN's bf16 GEMM beats an fp32 one; without, it converts inside the GEMM at
    a fraction of fp32's speed."""
    cpu = getattr(torch, "cpu", None)
    if any(getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")):
        return True
    try:
        return platform.machine() in ("aarch64", "arm64") and "bf16" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


BF16_GEMM = _bf16_gemm()
# [M, 1024] x [7168, 1024] in bf16 on 2 threads of the AVX2 EPYC: the bf16 GEMM 3.1 / 6.4 / 12.3 /
# 24.8 ms at M = 4 / 8 / 16 / 32, fp32 blocks 5.0 / 5.0 / 5.4 / 6.9 ms: the blocks win from ~7 rows
UPCAST_MIN_ROWS = 8
# float32 bytes of bf16 weight rows made float32 at once by `_upcast_linear` (measured at 32 MiB on
# the AVX2 EPYC it is for; q8.linear's block is smaller since, measured on its own path)
UPCAST_BLOCK_BYTES = 32 << 20


def _upcast_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A bf16 product of several rows on a CPU without bf16 hardware: a block of weight rows at a
    time made float32 and multiplied in float32 (oneDNN's sgemm), the result rounded to bf16 once.
    The same arithmetic as the bf16 GEMM there (bf16 inputs, float32 sums, a bf16 result) in
    another summation order, at fp32's speed: a 2,048-token prefill of a Qwen3.5-0.8B-shaped model
    ran at 16 tok/s through the bf16 GEMM on an AVX2 EPYC, at 80-86 tok/s this way (docs/BENCHMARKS.md,
    real size). Below UPCAST_MIN_ROWS rows (a batched decode step) the conversion of every weight,
    ~10 bytes moved per weight instead of 2, costs more than the slow GEMM."""
    n, k = w.shape
    return q8_reference.block_linear(x, n, k, lambda lo, hi: w[lo:hi].float(), bias, linear,
                                     out_dtype=torch.bfloat16, block_bytes=UPCAST_BLOCK_BYTES)

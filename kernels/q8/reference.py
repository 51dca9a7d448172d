"""int8 weights with a scale per group of 32 columns (llama.cpp's q8_0 idea): the format's
definition, in torch.

A weight W [N, K] is held as `q` int8 [N, K] and `scales` float32 [N, G], G = ceil(K / GROUP):
each row is cut into groups of GROUP consecutive columns (the last one shorter when K is not a
multiple), and a group's scale is its largest magnitude over 127, so that

    W[n, k] ~ q[n, k] * scales[n, k // GROUP],   q in [-127, 127] (symmetric: -128 unused)

and each weight is off by at most half a step (scales / 2). A group of zeros has scale 0. The
scales are float32 (q8_0 keeps fp16): 9 bits a weight instead of 8.5, and no group is too small
or too large for its scale. Activations stay float: `linear` is x @ dequantise(q, scales)^T in
float32, a block of rows of the weight dequantised at a time, so a product never holds the whole
weight in float32 (a prefill's path; one row takes kernels/native/gemv_q8.c).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

GROUP = 32
# float32 bytes of weight rows dequantised at once by `linear`: each block is one GEMM call whose
# threads meet at its end (on cores busy with other work each meeting can cost a scheduler slice:
# fewer, larger blocks), and its scratch sits on a prefill's peak. At real size 8 MiB blocks ran
# as fast as 32 and 2 with 56 MiB less peak (docs/BENCHMARKS.md, "Real size")
BLOCK_BYTES = 8 << 20


def groups(k: int) -> int:
    return -(-k // GROUP)


def quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scales float32 [N, G]) of a float weight [N, K], on its device; a weight
    that is not finite raises ValueError (no scale represents it)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantise: a float [N, K] weight, not {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    g = groups(k)
    wf = F.pad(w.float(), (0, g * GROUP - k)).view(n, g, GROUP)
    if not torch.isfinite(wf).all():
        raise ValueError("quantise: the weight holds a value that is not finite")
    scales = wf.abs().amax(-1) / 127  # [N, G]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(wf / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.view(n, g * GROUP)[:, :k].contiguous(), scales


def dequantise(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] that (q, scales) stand for (contiguous)."""
    n, k = q.shape
    g = scales.shape[1]
    if g != groups(k) or scales.shape[0] != n:
        raise ValueError(f"dequantise: scales {tuple(scales.shape)} for q {tuple(q.shape)}; need ({n}, {groups(k)})")
    padded = (q if k == g * GROUP else F.pad(q, (0, g * GROUP - k))).reshape(n, g, GROUP)
    w = padded.float().mul_(scales[..., None]).view(n, g * GROUP)  # (one float32 copy, scaled in place)
    return w if k == g * GROUP else w[:, :k].contiguous()


def linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
           product: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
    """x [..., K] @ dequantise(q, scales)^T (+ bias) -> [..., N] in float32, a block of weight
    rows (BLOCK_BYTES of float32) dequantised and multiplied at a time by `product` (F.linear's
    signature: the engine passes its CPU GEMM)."""
    n, k = q.shape
    return block_linear(x, n, k, lambda lo, hi: dequantise(q[lo:hi], scales[lo:hi]), bias, product)


def block_linear(x: torch.Tensor, n: int, k: int, weight_rows: Callable[[int, int], torch.Tensor],
                 bias: torch.Tensor | None = None, product: Callable[..., torch.Tensor] = F.linear,
                 out_dtype: torch.dtype = torch.float32, block_bytes: int | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in `out_dtype`, W [N, K] never whole in float32:
    `weight_rows(lo, hi)` makes rows lo..hi of it float32, `block_bytes` (BLOCK_BYTES) of them at
    a time, each block multiplied in float32 by `product` (also direct.py's bf16 product on a CPU
    without bf16 hardware)."""
    xf = x.float()
    b = None if bias is None else bias.float()
    rows = max(1, (BLOCK_BYTES if block_bytes is None else block_bytes) // (4 * max(1, k)))
    if rows >= n:
        y = product(xf, weight_rows(0, n), b)
        return y if out_dtype is torch.float32 else y.to(out_dtype)
    y = torch.empty(*x.shape[:-1], n, dtype=out_dtype, device=x.device)
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        y[..., lo:hi] = product(xf, weight_rows(lo, hi), None if b is None else b[lo:hi])
    return y

"""Which implementation of an op runs: Triton on CUDA, the torch reference on CPU.

    reference   always the torch reference (the oracle, and the CPU path)
    triton      always Triton (on CPU only under TRITON_INTERPRET=1: how CI tests kernels)
    auto        Triton when every tensor is on CUDA, else the reference

The choice is `select`ed once per process (EngineConfig.kernels; the CLI maps HCW_KERNELS onto it),
with the native CPU kernels' (EngineConfig.native, HCW_NATIVE). `empty` is the allocation every
launcher uses for its outputs; with `poison_empty` (the kernel tests) it fills them with NaN, so an
element a kernel forgot to write cannot pass a comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("auto", "reference", "triton")
FLOATS = (torch.float32, torch.float16, torch.bfloat16)  # what the kernels take for activations
NATIVE_MODES = ("auto", "0", "1")  # kernels/native: as available, never, required


@dataclass(frozen=True)
class Choice:
    kernels: str = "auto"
    native: str = "auto"


# the process's choice: ops are free functions called deep inside a forward, so it is one setting
# an entry point makes (`select`: the CLI, and an Engine whose EngineConfig names one), not an argument
_choice = Choice()


def select(kernels: str | None = None, native: str | None = None) -> None:
    """Which implementations the ops take from now on, in this process (None: as before)."""
    global _choice
    kernels, native = kernels or _choice.kernels, native or _choice.native
    if kernels not in MODES:
        raise ValueError(f"kernels={kernels!r}; one of {', '.join(MODES)}")
    if native not in NATIVE_MODES:
        raise ValueError(f"native={native!r}; one of {', '.join(NATIVE_MODES)}")
    _choice = Choice(kernels, native)


def mode() -> str:
    return _choice.kernels


def native_mode() -> str:
    return _choice.native


def use_triton(*tensors: torch.Tensor) -> bool:
    m = mode()
    if m != "auto":
        return m == "triton"
    return all(t.is_cuda for t in tensors)


poison_empty = False  # the kernel tests set it: a launcher's outputs start as NaN


def empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = torch.empty(*shape, dtype=dtype, device=device)
    if poison_empty and out.is_floating_point():
        out.fill_(float("nan"))
    return out


def check(name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...],
          device: torch.device) -> None:
    """Validation layer 4 at a kernel boundary: a tensor the kernel cannot take raises, with the
    reason, instead of being read with the wrong layout."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(t.shape)}, the kernel needs {tuple(shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype}, the kernel takes {', '.join(map(str, dtypes))}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, the others on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: not contiguous (strides {t.stride()})")
    if t.numel() and t.data_ptr() % 16:
        raise ValueError(f"{name}: base address not 16-byte aligned")

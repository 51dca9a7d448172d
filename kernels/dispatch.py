"""Which implementation of an op runs: Triton on CUDA, the torch reference on CPU.

    HCW_KERNELS=reference   always the torch reference (the oracle, and the CPU path)
    HCW_KERNELS=triton      always Triton (on CPU only under TRITON_INTERPRET=1: how CI tests kernels)
    unset / auto            Triton when every tensor is on CUDA, else the reference

`empty` is the allocation every launcher uses for its outputs; with HCW_POISON_EMPTY=1 (the kernel
tests) it fills them with NaN, so an element a kernel forgot to write cannot pass a comparison.
"""

from __future__ import annotations

import os

import torch

MODES = ("auto", "reference", "triton")
FLOATS = (torch.float32, torch.float16, torch.bfloat16)  # what the kernels take for activations


# CPython keeps os.environ's values in this dict (bytes keys on POSIX), updated by every
# os.environ write: a lookup there costs ~50 ns against os.environ.get's ~600 ns (key encoding,
# the Mapping machinery), and a CPU decode step asks ~25 times which path to take
_ENVIRON = getattr(os.environ, "_data", None) if os.name == "posix" else None


def getenv(name: str, default: str) -> str:
    """os.environ.get(name, default), at a dict lookup's cost where CPython allows."""
    if _ENVIRON is None:
        return os.environ.get(name, default)
    value = _ENVIRON.get(name.encode())
    return default if value is None else os.fsdecode(value)


def mode() -> str:
    value = getenv("HCW_KERNELS", "auto") or "auto"
    if value not in MODES:
        raise ValueError(f"HCW_KERNELS={value!r}; one of {', '.join(MODES)}")
    return value


def use_triton(*tensors: torch.Tensor) -> bool:
    m = mode()
    if m != "auto":
        return m == "triton"
    return all(t.is_cuda for t in tensors)


def empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = torch.empty(*shape, dtype=dtype, device=device)
    if os.environ.get("HCW_POISON_EMPTY") == "1" and out.is_floating_point():
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

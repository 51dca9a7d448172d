"""`EngineConfig`: what the user chooses at run time (dtype, device, chunking, bit-exact mode, KV
layout, kernels, static decode, the prefix cache's CacheConfig), built once at the entry point; `from_env` maps the HCW_*
variables onto it, and no library code reads them itself."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from engine.cache.config import CacheConfig
from engine.config import ConfigError
from kernels import dispatch

KV_LAYOUTS = ("auto", "dense", "paged")
KERNEL_CHOICES, NATIVE_CHOICES = dispatch.MODES, dispatch.NATIVE_MODES
# the environment variables an entry point maps onto EngineConfig (EngineConfig.from_env)
ENV_FIELDS = {"HCW_KV": ("kv_layout", KV_LAYOUTS), "HCW_KERNELS": ("kernels", KERNEL_CHOICES),
              "HCW_NATIVE": ("native", NATIVE_CHOICES), "HCW_STATIC": ("static", ("0", "1"))}


@dataclass(frozen=True)
class EngineConfig:
    """What the user chooses at run time; built once at the entry point (`from_env` maps the
    HCW_* variables onto it), never read from the environment by library code."""

    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    # tokens a prefill pass takes; None: the engine's own (engine.engine.default_prefill_chunk: 2048
    # on a GPU, fewer on the CPU where a chunk's working set would grow the resident memory)
    prefill_chunk_size: int | None = None
    # with the default chunk, at most this many tokens a pass (an interactive caller's bound on how
    # long a cancel, heard between two passes, can wait); None: no bound
    prefill_chunk_most: int | None = None
    # bit-exact: prefill and Tail-Replay take one token a step, the path decode takes, so no row's
    # arithmetic depends on how a prompt was chunked or where a cache hit ended (docs/ARCHITECTURE.md,
    # "What exact means"); prefill then runs at decode's speed
    deterministic: bool = False
    # full attention's KV: dense (one buffer, read by scaled_dot_product_attention), paged (a block
    # pool read by the paged-attention kernels) or auto (paged, on the CPU too). The engine
    # sets it on its model; a PrefixCache assembles states of the layout its model had when it was
    # made, so an entry point with a cache sets it on the model first (ChatSession does)
    kv_layout: str | None = None
    # which op implementations run (kernels/dispatch.py): auto (Triton on CUDA), reference, triton;
    # and the C kernels of CPU decode (kernels/native): auto, 0 (never), 1 (required)
    kernels: str | None = None
    native: str | None = None
    static: bool = False  # decode captured as a CUDA graph (engine/static_decode.py)
    # the prefix cache's settings, which the entry point builds its PrefixCache with (with the
    # lower tier it chose); None: no cache settings given (an engine without a cache, or a test's)
    cache: CacheConfig | None = None
    # (None above: leave what the process or the model has, e.g. an engine a command makes beside its main one)

    def __post_init__(self) -> None:
        for name in ("prefill_chunk_size", "prefill_chunk_most"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        for name, choices in (("kv_layout", KV_LAYOUTS), ("kernels", KERNEL_CHOICES), ("native", NATIVE_CHOICES)):
            if getattr(self, name) not in (None, *choices):
                raise ConfigError(f"{name}={getattr(self, name)!r}; one of {', '.join(choices)}")
        if self.cache is not None and self.cache.deterministic != self.deterministic:
            # a cache's states are made (and fingerprinted) under one arithmetic
            raise ConfigError("the engine and the cache must agree on deterministic (bit-exact) arithmetic")

    def bind(self, model) -> EngineConfig:
        """This config for a loaded model: its KV layout set on the model (before a cache is made
        for it: a PrefixCache assembles states of the layout its model had), dtype and device
        the model's."""
        if self.kv_layout is not None:
            model.use_kv_layout(self.kv_layout)
        return replace(self, dtype=model.dtype, device=str(model.device))

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **given) -> EngineConfig:
        """The config an entry point runs with: `given`, plus HCW_KV, HCW_KERNELS, HCW_NATIVE and
        HCW_STATIC from `environ` (unset or empty: the default). A bad value raises ConfigError
        naming the variable."""
        for var, (name, choices) in ENV_FIELDS.items():
            value = environ.get(var) or None
            if value is None:
                continue
            if value not in choices:
                raise ConfigError(f"{var}={value!r}; one of {', '.join(choices)}")
            given.setdefault(name, value == "1" if name == "static" else value)
        return cls(**given)

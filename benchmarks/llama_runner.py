"""llama-cpp-python's low-level calls for the benchmarks that compare against llama.cpp. Imports
neither torch nor the engine: a process that runs only llama.cpp (benchmarks/real_size.py's
worker) holds only what llama.cpp needs, so its resident memory is llama.cpp's own."""

from __future__ import annotations

import contextlib
import ctypes
import time
from pathlib import Path

import numpy as np


class LlamaRunner:
    """One Llama object, last-token logits only."""

    def __init__(self, path: Path, n_ctx: int, rollback: int = 0, threads: int = 2, repack: bool = True):
        """`repack` False: llama.cpp keeps the weights as stored (no extra buffer types, so no
        repacked layout for its AMX or other CPU-specific kernels)."""
        import llama_cpp
        import llama_cpp.llama_cpp as low  # what Llama() reads its context and model defaults from

        self.lib = llama_cpp
        default, model_default = low.llama_context_default_params, low.llama_model_default_params

        def with_rollback():
            params = default()
            params.n_rs_seq = rollback  # experimental recurrent-state snapshots for rollback
            return params

        def as_stored():
            params = model_default()
            params.use_extra_bufts = False
            return params

        with (_patched(low, "llama_context_default_params", with_rollback if rollback else default),
              _patched(low, "llama_model_default_params", model_default if repack else as_stored)):
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=2048, n_ubatch=512,
                                       n_threads=threads, n_threads_batch=threads, verbose=False)
        self.vocab = self.llm.n_vocab()

    def logits(self) -> np.ndarray:
        ptr = self.lib.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.vocab,)).copy()

    def prefill(self, ids: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(ids)
        return self.logits()

    def extend(self, ids: list[int], keep: int) -> tuple[np.ndarray, bool]:
        """Continue from the first `keep` tokens held (append, or an edit that drops the rest);
        when the memory cannot drop them, the whole prompt is reprocessed, as llama.cpp's server does.
        Returns the logits and whether the held state was reused."""
        reused = keep == self.llm.n_tokens or self.llm._ctx.kv_cache_seq_rm(-1, keep, -1)
        if reused:
            self.llm.n_tokens = keep
            self.llm.eval(ids[keep:])
        else:
            self.llm.reset()
            self.llm.eval(ids)
        return self.logits(), bool(reused)

    def decode(self, steps: int) -> float:
        tok = int(self.logits().argmax())
        t0 = time.perf_counter()
        for _ in range(steps):
            self.llm.eval([tok])
            tok = int(self.logits().argmax())
        return time.perf_counter() - t0


@contextlib.contextmanager
def _patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)

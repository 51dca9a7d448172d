"""Static decode: one token per step through buffers that never move, so that on CUDA the whole
step is captured once as a CUDA graph and then replayed (one launch instead of hundreds).

What makes a step static: positions are tensors (`PagedKVState.at`, `Rotary.apply_at`), keys and
values go into a paged pool reserved ahead (`PagedKVState.reserve`), GDN states are updated in
place (`GDNState.static`) and a step's GDN statistics go to a fixed buffer that the decoder appends
after the step (`GDNState.commit_step`). The Python bookkeeping (seq_len, lengths) happens around
the step, never inside it: a replayed graph runs no Python.

The topology guard (engine/cache/rules.py) is frozen at capture with the fingerprint of every
buffer the step reads or writes (address, shape, dtype), the statistics switch and the prefix
cache's topology fingerprint (layer kinds, piece shapes and dtypes, block size); every step
checks it first, and a change (a prefill that grew a pool or replaced a GDN state, a turn that
stopped recording statistics) means run uncaptured and capture again, never a replay over other
memory.

On CPU nothing is captured: the same static step runs eagerly, which is how the tests compare it
with the ordinary decode. `EngineConfig.static` (the CLI maps HCW_STATIC=1 onto it) turns it on
in `Engine.decode`; off by default.
"""

from __future__ import annotations

import weakref

import torch

from engine.cache.rules import TopologyGuard
from engine.cache.gdn_state import GDNState
from engine.cache.kv import PAGE, KVState, PagedKVState
from engine.cache.states import ModelState

WARMUP = 2  # uncaptured steps before a capture: kernels compiled, workspaces and the allocator settled


class StaticUnsupported(Exception):
    """A model or state the static step does not cover (the engine then decodes as usual)."""


class StaticDecoder:
    """Decodes one token per `step` for one ModelState, which it owns the buffers of from then on."""

    def __init__(self, model, state: ModelState, capacity: int | None = None, topology: bytes = b""):
        from engine.model.attention import GatedAttention
        from engine.model.gdn import GatedDeltaNet

        from engine.model.mlp import MLP

        if getattr(model, "hc_head", None) is not None:
            raise StaticUnsupported("hyper-connected blocks")
        mixers = [blk.mixer for blk in model.layers]
        if not all(isinstance(m, (GatedAttention, GatedDeltaNet)) for m in mixers):
            kinds = sorted({m.kind for m in mixers if not isinstance(m, (GatedAttention, GatedDeltaNet))})
            raise StaticUnsupported(f"layer kinds {', '.join(kinds)}")
        if not all(type(blk.mlp) is MLP for blk in model.layers):  # a MoE routes by reading the router's choice back
            raise StaticUnsupported("mixture-of-experts feed-forward layers")
        self.model = model
        self.topology = topology  # the prefix cache's layout fingerprint (rule 4), frozen with the buffers
        self._state = weakref.ref(state)  # the state holds its decoder (state.extra), not the reverse
        need = state.seq_len + 1
        limit = max(need, model.config.max_position_embeddings)
        self.capacity = capacity or min(-(-max(2 * need, need + 1024) // PAGE) * PAGE, limit)
        if self.capacity < need:
            raise ValueError(f"capacity {self.capacity} < {need} positions")
        device, dtype = model.device, model.dtype
        batch = _batch(state)
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        for i, (mixer, layer) in enumerate(zip(mixers, state.layers)):
            if isinstance(mixer, GatedAttention):
                if isinstance(layer, KVState):  # the dense buffer moves into a pool of its own
                    paged = PagedKVState.empty(batch, mixer.n_kv, mixer.head_dim, dtype, device, self.capacity)
                    paged.append(*layer.read(layer.length))
                    layer = state.layers[i] = paged
                layer.reserve(self.capacity)
                mixer.rotary.reserve(self.capacity, mixer.head_dim, dtype, device)
            else:  # its own copies: updated in place from now on, never a tensor the cache also holds
                layer.recurrent = layer.recurrent.clone()
                layer.conv = layer.conv.clone()
                layer.norm = layer.norm.clone()
                layer.step = torch.zeros(batch, layer.recurrent.shape[1], 2, dtype=torch.float32, device=device)
                layer.step_norm = torch.zeros_like(layer.norm)
        self.guard = TopologyGuard()
        self.graph = None
        self.out: torch.Tensor | None = None
        self.uncaptured = 0  # steps run since the last capture was dropped (or since the start)
        self.captures = 0
        self.capture_error = ""  # why capturing failed, after which the step always runs uncaptured

    @property
    def state(self) -> ModelState:
        state = self._state()
        if state is None:
            raise RuntimeError("the decoder's state is gone")
        return state

    def fits(self, state: ModelState) -> bool:
        """Whether the next step of `state` can be this decoder's."""
        return state is self._state() and state.seq_len < self.capacity

    def fingerprint(self) -> tuple:
        """Every buffer the step touches (address, shape, stride, dtype) — the state's, the RoPE
        tables (shared by every state: a longer prefill elsewhere rebuilds them), the weights and
        the tensors derived from them — and whether each GDN layer records statistics."""
        tensors = [self.token, self.pos]
        flags = []
        for layer in self.state.layers:
            if isinstance(layer, PagedKVState):
                tensors += [layer.k_pool, layer.v_pool, layer.table, layer.lengths]
            elif isinstance(layer, GDNState):
                tensors += [layer.conv, layer.recurrent, layer.norm, layer.step, layer.step_norm]
                flags.append(layer.tracking)
            else:
                flags.append(type(layer).__name__)  # a layer state the step does not expect
        for module in self.model.modules():
            tensors += [p for p in module._parameters.values() if p is not None]
            tensors += [entry[2] for entry in module.__dict__.get("_derived", {}).values()]
            rotary = getattr(module, "rotary", None)
            for table in getattr(rotary, "_tables", {}).values():
                tensors += list(table)
        return (self.topology, *flags) + tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors)

    def step(self, token: int) -> torch.Tensor:
        """Logits [B, vocab] for `token` at position state.seq_len; the state advances by one."""
        state = self.state
        if state.seq_len >= self.capacity:
            raise IndexError(f"position {state.seq_len} is past the decoder's capacity {self.capacity}")
        position = state.seq_len
        self.token.fill_(token)
        self.pos.fill_(position)
        if self.graph is not None and not self.guard.check(self.fingerprint()):
            self.graph, self.uncaptured = None, 0  # the buffers moved: capture again after a warm-up
        if self.graph is not None:
            self.graph.replay()
        elif self.token.is_cuda and self.uncaptured >= WARMUP and not self.capture_error and self._capture():
            pass
        else:
            self.out = self._run()
            self.uncaptured += 1
        state.seq_len += 1
        for layer in state.layers:
            if isinstance(layer, PagedKVState):
                layer.length += 1
            elif isinstance(layer, GDNState):
                layer.commit_step(position)
        return self.out[:, -1].clone()  # the graph's output is overwritten by the next replay

    def _run(self) -> torch.Tensor:
        """The step itself: tensor positions and in-place states only (what the graph records)."""
        for layer in self.state.layers:
            if isinstance(layer, PagedKVState):
                layer.at = self.pos
            elif isinstance(layer, GDNState):
                layer.static = True
        try:
            m = self.model
            x = m.embed_tokens(self.token)
            for blk, layer in zip(m.layers, self.state.layers):
                x = blk(x, layer, -1, self.token)  # (the start argument is unused on the static path)
            return m.lm_head(m.norm(x))
        finally:
            for layer in self.state.layers:
                if isinstance(layer, PagedKVState):
                    layer.at = None
                elif isinstance(layer, GDNState):
                    layer.static = False

    def _capture(self) -> bool:
        """Capture the step and run it once; False (and the reason kept) when CUDA refuses, e.g. an
        op that reads a value back from the device: the step then always runs uncaptured."""
        from kernels.dispatch import mode

        if mode() == "reference":  # the torch references read lengths back: not capturable
            self.capture_error = "kernels: reference"
            return False
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = self._run()
        except RuntimeError as e:  # kept and reported (capture_error); the step runs uncaptured
            self.capture_error = f"{type(e).__name__}: {e}"
            return False
        self.out = out
        self.guard.freeze(self.fingerprint())
        self.graph = graph
        self.captures += 1
        graph.replay()  # capturing records the step without running it
        return True


def _batch(state: ModelState) -> int:
    for layer in state.layers:
        if isinstance(layer, KVState):
            return layer.k.shape[0]
        if isinstance(layer, PagedKVState):
            return layer.table.shape[0]
        if isinstance(layer, GDNState):
            return layer.recurrent.shape[0]
    return 1

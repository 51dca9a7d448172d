"""Every weight is held once, in the layout it is used in (issue 27, item 1).

A model with real layer shapes (hidden 1024, fused GDN / attention / MLP projections that are a
large share of the bytes, as in Qwen3.5-0.8B) is loaded in a fresh process and its resident set
measured after the load (and at the load's peak) and after a first prefill and a few decode steps:
each stays within 1.2x the weights' bytes plus RUNTIME. In process, the storages reachable from the
model and its caches add up to the weights' bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine.model.derived import derived
from engine.model.loader import load_model
from engine.model.random_init import qwen3_5_text_dict, write_random_model

# what a process holds beyond the weights once it has run a prefill: the code pages of the
# libraries a first forward pass brings in (oneDNN's kernels, the native kernels: ~20 MiB
# measured), the state and activations of a 64-token prefill at hidden 1024 (a few MiB), the
# allocator's slack; and, at the load's peak, the file pages read for at most 64 MiB of rebuilt
# weights before they are given back (loader._DROP_EVERY)
RUNTIME = 96 << 20

_MEASURE = r"""
import gc, json, sys
import torch
from engine.engine import Engine
from engine.model.loader import load_model

def rss():
    f = dict(line.split(":", 1) for line in open("/proc/self/status"))
    kib = lambda k: int(f[k].split()[0]) << 10
    return kib("RssAnon") + kib("RssFile"), kib("VmHWM")

base, _ = rss()
model = load_model(sys.argv[1], dtype=sys.argv[2], device="cpu")
gc.collect()
loaded, load_peak = rss()
engine = Engine(model)
state = engine.new_state()
engine.prefill(list(range(64)), state)
for _ in range(4):
    engine.decode(5, state)
gc.collect()
ran, _ = rss()
held = [*model.parameters(), *(b for n, b in model.named_buffers() if n.endswith(("weight_q8", "weight_scale")))]
weights = sum({p.untyped_storage().data_ptr(): p.nbytes for p in held}.values())
print(json.dumps({"weights": weights, "load": loaded - base, "load_peak": load_peak - base, "prefill": ran - base}))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # ~390 MB in bf16: 12 layers of Qwen3.5-0.8B's width, a 32K vocabulary, tied embeddings
    raw = qwen3_5_text_dict(hidden=1024, layers=12, vocab=32768)
    raw["tie_word_embeddings"] = True
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        folder = write_random_model(tmp_path_factory.mktemp("weights_once"), raw)
    finally:
        torch.set_default_dtype(saved)
    # on disk, as a model folder is: pages of a file still dirty in the page cache stayed resident
    # in a loading process, ~100 MiB over the weights right after writing (the kernel's, not ours)
    os.sync()
    return folder


def _measure(folder, dtype: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(folder), dtype], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="reads the resident set from /proc/self/status")
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "int8"])
def test_resident_set_is_the_weights_once(model_dir, dtype):
    m = _measure(model_dir, dtype)
    bound = 1.2 * m["weights"] + RUNTIME
    mib = {k: f"{v / 2**20:.0f} MiB" for k, v in m.items()}
    for point in ("load", "load_peak", "prefill"):
        assert m[point] <= bound, f"{point}: {mib} (bound {bound / 2**20:.0f} MiB)"


def _held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages reachable from the model's modules: parameters, buffers
    and whatever a module keeps (derived caches, held views), one level of containers down."""
    storages: dict[int, int] = {}

    def visit(value, depth: int = 0) -> None:
        if isinstance(value, torch.Tensor):
            s = value.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        elif isinstance(value, dict) and depth < 3:
            for v in value.values():
                visit(v, depth + 1)
        elif isinstance(value, (list, tuple)) and depth < 3:
            for v in value:
                visit(v, depth + 1)

    for mod in model.modules():
        visit(vars(mod))
    return sum(storages.values())


def _weight_bytes(model: torch.nn.Module) -> int:
    """Parameters, and the int8 weights' buffers (--dtype int8 holds a projection as those only)."""
    held = [*model.parameters(), *(b for n, b in model.named_buffers() if n.endswith(("weight_q8", "weight_scale")))]
    return sum({p.data_ptr(): p.nbytes for p in held}.values())


# the caches derived from weights: fp32 norm scales, -exp(A_log), the conv taps (a few KB a layer)
DERIVED = 1 << 20


@pytest.fixture(scope="module", params=["bf16", "int8"])
def ran_model(model_dir, request):
    model = load_model(model_dir, dtype=request.param, device="cpu")
    with torch.inference_mode(False), torch.no_grad():
        model(torch.arange(16)[None], model.new_state())
    return model


def test_no_storage_is_held_twice(ran_model):
    emb, head = ran_model.embed_tokens, ran_model.lm_head
    assert emb.int8 == head.int8  # tied: one tensor, or one int8 table and its scales
    assert (head.weight_q8 is emb.weight_q8 and head.weight_scale is emb.weight_scale) if emb.int8 else head.weight is emb.weight
    assert _held_bytes(ran_model) <= _weight_bytes(ran_model) + DERIVED


def test_a_cached_copy_of_a_weight_is_counted(ran_model):
    # the check above can fail: a transposed copy of the LM head kept beside it is seen
    head = ran_model.lm_head
    held = head.weight_q8 if head.int8 else head.weight
    with torch.no_grad():
        derived(head, "flipped", held, lambda w: w.t().contiguous())
    try:
        assert _held_bytes(ran_model) > _weight_bytes(ran_model) + DERIVED
    finally:
        head.__dict__["_derived"].pop("flipped")


def test_show_reports_the_weights_bytes(model_dir, ran_model):
    from engine.model.int8 import weights_format
    from workbench.catalog import describe

    assert describe(model_dir)["weight_bytes"][weights_format(ran_model)] == _weight_bytes(ran_model)


def test_the_attention_layers_share_one_rope_table():
    from engine.engine import Engine
    from engine.model.rope import Rotary

    model = load_model("hcw-tiny-qwen3.5", device="cpu")
    rotaries = [mod.rotary for mod in model.modules() if isinstance(getattr(mod, "rotary", None), Rotary)]
    assert len(rotaries) >= 2 and all(r is rotaries[0] for r in rotaries)
    engine = Engine(model)
    engine.prefill([i % model.config.vocab_size for i in range(300)], engine.new_state())
    assert len(rotaries[0]._tables) == 1  # one (head dim, dtype, device): one cos/sin pair for every layer

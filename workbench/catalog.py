"""`hcw models` and `hcw show`: the built-in models, or one model folder, described from its
config.json without loading its weights: layer kinds, parameters (the model built on the meta
device: no memory, no file read but the config), tokenizer, and what one sequence's state costs.

The state's bytes come from the config by the shapes each layer kind keeps (engine/cache/kv.py, gdn_state.py, v4_state.py),
per state kind as the layer's `StateObject`s name them; tests/test_cli_models.py holds them equal
to the bytes of a real state after a prefill. A sequence of T tokens holds
    full attention     kv              2 · kv heads · head_dim per token
    Gated DeltaNet     recurrent       value heads · key dim · value dim (float32), and conv: the
                                       last kernel-1 inputs, whatever T is
    sliding / V4 kinds window          the last sliding_window-1 keys
    CSA / HCA          compressed      one head_dim entry per `rate` tokens (CSA: csa_rate, HCA:
                                       hca_rate), tail: the open window's projections; CSA adds the
                                       overlap (a closed window kept for the next entry) and the
                                       indexer's own keys, tail and overlap at index_head_dim
The prefix cache also keeps each GDN layer's decay statistics (8 bytes per token per value head)
while a segment is open; they are not counted here.
"""

from __future__ import annotations

import collections
from math import lcm
from pathlib import Path

import psutil
import torch

from engine.cache.config import CacheConfig
from engine.cache.states import COMPRESSOR_KINDS, Kind
from engine.config import ModelConfig, compute_dtype
from engine.model.loader import BUILTIN_MODELS, resolve_model, stored_format
from engine.tokenizer import HFTokenizer, load_tokenizer

SHORT = {"linear_attention": "gdn", "full_attention": "full", "sliding_attention": "sliding",
         "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}


def state_bytes(cfg: ModelConfig, tokens: int, dtype: str | torch.dtype = "fp32") -> dict[str, int]:
    """Bytes of one sequence's state after `tokens` tokens, by state kind (summed over layers)."""
    e = compute_dtype(dtype).itemsize
    out: collections.Counter = collections.Counter()
    for kind in cfg.layer_types:
        if kind == "full_attention":
            out[Kind.KV] += 2 * cfg.num_key_value_heads * cfg.head_dim * tokens * e
            continue
        if kind == "linear_attention":
            keys, values = cfg.linear_num_key_heads * cfg.linear_key_head_dim, \
                cfg.linear_num_value_heads * cfg.linear_value_head_dim
            out[Kind.RECURRENT] += cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
            out[Kind.CONV] += (2 * keys + values) * (cfg.linear_conv_kernel_dim - 1) * e
            continue
        d = cfg.head_dim
        out[Kind.WINDOW] += min(tokens, max(cfg.sliding_window - 1, 0)) * d * e
        if kind == "sliding_attention":
            continue
        rate = cfg.compress_rate(kind)
        overlap = kind == "compressed_sparse_attention"
        _compressor(out, "", rate, d, overlap, tokens, e)
        if overlap:  # the lightning indexer's own (overlapping) compressor
            _compressor(out, "index_", rate, cfg.index_head_dim, True, tokens, e)
    return dict(out)


def _compressor(out: collections.Counter, prefix: str, rate: int, dim: int, overlap: bool, tokens: int,
                e: int) -> None:
    closed, open_ = divmod(tokens, rate)
    width = 2 * dim if overlap else dim  # an overlapping compressor projects two series
    entries, tail, overlap_kind = COMPRESSOR_KINDS[prefix]
    out[entries] += closed * dim * e
    out[tail] += 2 * open_ * width * e  # projections and gate logits of the open window
    if overlap and closed:
        out[overlap_kind] += 2 * rate * dim * e


def state_cost(cfg: ModelConfig, dtype: str | torch.dtype = "fp32") -> dict:
    """{"per_token": bytes each further token adds (on average over a compressor's window),
    "fixed": bytes a long sequence holds whatever its length}: bytes(T) = fixed + per_token · T at
    every T that closes all compressor windows and fills the sliding window."""
    period = lcm(*(cfg.compress_rate(k) for k in set(cfg.layer_types) if k in ("compressed_sparse_attention",
                                                                               "heavily_compressed_attention")))
    t0 = period * max(1, -(-cfg.sliding_window // period))
    a, b = sum(state_bytes(cfg, t0, dtype).values()), sum(state_bytes(cfg, t0 + period, dtype).values())
    per_token = (b - a) / period
    return {"per_token": per_token, "fixed": round(a - per_token * t0)}


def parameters(cfg: ModelConfig) -> int:
    """The model's parameters (tied embeddings once), counted on the meta device."""
    from engine.model.hybrid import HybridModel

    with torch.device("meta"):
        model = HybridModel(cfg)
    return sum(p.numel() for p in model.parameters())


def weight_bytes(cfg: ModelConfig) -> dict[str, int]:
    """Bytes of the weights as loaded under each dtype (tied embeddings once; the loader holds each
    weight once, so this is what they take in memory), counted on the meta device; int8: the
    projections (and a tied embedding, once) int8 with their scales, the rest float32
    (engine/model/int8.py's rule)."""
    from engine.model.hybrid import HybridModel
    from engine.model.int8 import int8_bytes, int8_weights
    from engine.model.loader import _param_dtype

    with torch.device("meta"):
        model = HybridModel(cfg)
    out = {name: sum(p.numel() * _param_dtype(cfg, k, p, dtype).itemsize for k, p in model.named_parameters())
           for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))}
    quantised = set(int8_weights(model))
    out["int8"] = sum(int8_bytes(p.shape) if k in quantised else p.numel() * _param_dtype(cfg, k, p, torch.float32).itemsize
                      for k, p in model.named_parameters())
    return out


def describe(name: str | Path) -> dict:
    """A built-in model's name or a folder: ConfigError (a ValueError) when it is neither or
    its config cannot be run."""
    folder = resolve_model(name)
    cfg = ModelConfig.from_folder(folder)
    tok = load_tokenizer(folder, cfg.extra)
    kinds = collections.Counter(cfg.layer_types)
    stored = stored_format(folder)  # a folder `hcw quantise` wrote loads as int8 only
    held = weight_bytes(cfg)
    return {
        "name": str(name) if str(name) in BUILTIN_MODELS and not Path(name).is_dir() else folder.name,
        "path": str(folder),
        "model_type": cfg.model_type,
        "layers": cfg.num_hidden_layers,
        "layer_kinds": {k: kinds[k] for k in SHORT if k in kinds},
        "layer_types": list(cfg.layer_types),
        "parameters": parameters(cfg),
        "weight_bytes": {stored: held[stored]} if stored else held,
        "stored": stored,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "context": cfg.max_position_embeddings,
        "experts": cfg.num_experts,
        "tokenizer": None if tok is None else "tokenizer.json" if isinstance(tok, HFTokenizer) else "bytes",
        "chat_template": bool(tok is not None and getattr(tok, "chat_template", None)),
        "state_fp32": state_cost(cfg),
        "state_fp32_at_4096": state_bytes(cfg, 4096),
        # what else a run holds: the prefix cache's in-memory budget (then the disk tier), and the
        # runtime, measured as this process's resident memory (Python, torch), no weights loaded
        "cache_budget_bytes": CacheConfig().budget_bytes,
        "runtime_bytes": psutil.Process().memory_info().rss,
    }


def builtins() -> list[dict]:
    return [describe(name) for name in BUILTIN_MODELS]


def kinds_line(model: dict) -> str:
    return " ".join(f"{SHORT[k]}×{n}" for k, n in model["layer_kinds"].items())


def size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:g} B"


def per_token(n: float) -> str:
    return f"{n:,.0f} B" if n == round(n) else f"{n:,.1f} B"


def count(n: int) -> str:
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def table(models: list[dict]) -> str:
    rows = [("name", "params", "layers", "state/token", "fixed state", "layer kinds")]
    for m in models:
        rows.append((m["name"], count(m["parameters"]), str(m["layers"]), per_token(m["state_fp32"]["per_token"]),
                     size(m["state_fp32"]["fixed"]), kinds_line(m)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join([*(c.ljust(w) if i in (0,) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))), r[-1]])
             for r in rows]
    return "\n".join(lines) + "\n(state: one sequence's, in fp32; `hcw show NAME` for more)\n"


def details(m: dict) -> str:
    cost = m["state_fp32"]
    tok = {"bytes": "byte-level (built in)", "tokenizer.json": "tokenizer.json", None: None}[m["tokenizer"]] or \
        "none (token ids only: hcw generate --prompt-ids)"
    if m["tokenizer"]:
        tok += ", with a chat template" if m["chat_template"] else ", no chat template"
    lines = [
        f"{m['name']}  ({m['path']})",
        f"  model_type   {m['model_type']}",
        f"  parameters   {count(m['parameters'])} ({m['parameters']:,})",
        f"  weights      {'   '.join(f'{size(n)} in {dt}' for dt, n in m['weight_bytes'].items())} (held once)"
        + (f", stored {m['stored']} by hcw quantise: load with --dtype {m['stored']}" if m.get("stored") else ""),
        f"  layers       {m['layers']}: {kinds_line(m)}",
        f"  order        {' '.join(SHORT[k] for k in m['layer_types'])}",
        f"  hidden       {m['hidden_size']}   vocab {m['vocab_size']}   context {m['context']}"
        + (f"   experts {m['experts']}" if m["experts"] else ""),
        f"  tokenizer    {tok}",
        f"  state (fp32) {per_token(cost['per_token'])} per token + {size(cost['fixed'])} fixed; at 4096 tokens "
        f"{size(sum(m['state_fp32_at_4096'].values()))}:",
    ]
    lines += [f"    {kind:14} {size(n)}" for kind, n in m["state_fp32_at_4096"].items() if n]
    lines += [f"  cache        up to {size(m['cache_budget_bytes'])} of segments in memory, then the disk tier",
              f"  runtime      {size(m['runtime_bytes'])} (Python and torch: this process, no weights loaded)"]
    return "\n".join(lines) + "\n"

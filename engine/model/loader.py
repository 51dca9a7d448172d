"""Load a model folder (config.json + safetensors, single file or sharded index) into HybridModel.

Checkpoint names are mapped onto ours by stripping the family's prefix; two layouts are rewritten
on the way in so one module serves every family:
- Qwen3-Next's fused `in_proj_qkvz` / `in_proj_ba` (interleaved per key head) become the split
  `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` of Qwen3.5;
- per-expert MoE weights (`experts.{e}.gate_proj.weight`, ...) become the stacked tensors.
Every missing, unexpected or mis-shaped tensor is an error that names the tensor.

`save_int8` (`hcw quantise`) writes a model's int8 weights as a folder of their own, which loads
under `--dtype int8` without quantising again, its weights views of the file (as a GGUF q8_0 is
read): the loader's own tensors under `hcw.` names, each int8 weight (fused, in our layout) as
`hcw.int8.<name>.q` and `.scales`, everything else as the checkpoint held it.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

import torch
import xxhash
from torch import nn
from safetensors import SafetensorError, safe_open

from engine.config import ConfigError, ModelConfig, compute_dtype, parse_dtype
from engine.heap import trim as trim_heap
from engine.model.file_pages import drop_resident, file_ranges
from engine.model.fused import FusedLinear
from engine.model.hybrid import HybridModel
from engine.model.int8 import int8_weights
from engine.model.weights_digest import files_digest, header_digest
from kernels import q8
from kernels.native import quantise_q8 as native_quantise

LOADER_VERSION = 1  # bump when load_model turns the same files into different tensors (part of the digest)

# a folder save_int8 wrote names its tensors with these (the loader's names after renaming), and
# says in its files' metadata which layout of them it holds (bump when that layout changes)
STORED, STORED_INT8 = "hcw.", "hcw.int8."
STORED_LAYOUT = "int8/1"

# parts of multimodal / multi-token-prediction checkpoints that the language model never reads
IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")


class WeightsError(ValueError):
    """The weights in a folder do not match its config."""


# models shipped inside the package (package data), loadable by name
_MODELS = Path(__file__).resolve().parent.parent / "models"
# hcw-tiny: every layer kind (the default); hcw-tiny-qwen3.5: the Qwen3.5 architecture (3 GDN : 1
# gated attention) trained by the same script on the same data, for Tail-Replay's measurements
BUILTIN_MODELS = {"hcw-tiny": _MODELS / "hcw-tiny", "hcw-tiny-qwen3.5": _MODELS / "hcw-tiny-qwen3.5"}


def resolve_model(path: str | Path) -> Path:
    """A model folder, or the folder of a built-in model named `path` (a folder of that name wins)."""
    folder = Path(path)
    if not folder.is_dir() and str(path) in BUILTIN_MODELS:
        folder = BUILTIN_MODELS[str(path)]
    if not folder.is_dir():
        names = ", ".join(BUILTIN_MODELS)
        raise ConfigError(f"model folder {folder} does not exist (built-in models: {names})")
    return folder


def load_model(path: str | Path, dtype: str | torch.dtype = "fp32", device: str | None = None) -> HybridModel:
    """Build the model described by `path/config.json` (or a built-in model's name, e.g.
    "hcw-tiny") and load its safetensors weights. dtype "int8" (torch.int8): the projections
    quantised from the checkpoint's weights and held as int8 only, the rest float32
    (engine/model/int8.py)."""
    folder = resolve_model(path)
    cfg = ModelConfig.from_folder(folder)
    int8 = parse_dtype(dtype) is torch.int8
    dtype = compute_dtype(dtype)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = _meta_model(folder, cfg)
    files = _weight_files(folder)
    # the files stay open while the weights are built, so that the pages read to build one can be
    # given back at once (engine/model/file_pages.py): every weight is then held once, in its final
    # layout; one used as stored stays a view of the mapping, read from the file on first use
    with contextlib.ExitStack() as files_open:
        raw, mapped = _read_safetensors(files, files_open)
        quantised = int8_weights(model) if int8 else {}
        dropper = _Dropper(mapped)
        stored = _stored(raw, folder, quantised.keys() if int8 else None)
        if stored is None:
            state = _to_our_names(cfg, raw)  # (no second reference: each original is freed when replaced)
            del raw
            _check(model, state)
            # before the fusing: a fused int8 weight is quantised from its parts, with no fused copy
            held_int8 = _quantise(state, quantised.keys(), dict(_fused_modules(model)), device, dropper, cfg)
        else:  # written by save_int8: the int8 weights used as stored
            (state, held_int8), raw = stored, None
            _stored_layout(files)
            _check(model, state, held_int8)
            held_int8 = {k: (q.to(device), s.to(device)) for k, (q, s) in held_int8.items()}
        _fuse(model, state, dropper, done=held_int8.keys())
        transposed = _transposed_names(model) - quantised.keys() if torch.device(device).type == "cpu" else set()
        _final_layout(cfg, state, dtype, device, transposed, dropper)
    model.load_state_dict(state, strict=False, assign=True)
    for name, (q, scales) in held_int8.items():
        quantised[name].quantise(q, scales)
    if cfg.tie_word_embeddings and int8:  # one int8 table: the head takes the embedding's
        model.lm_head.quantise(model.embed_tokens.weight_q8, model.embed_tokens.weight_scale)
    elif cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # every byte of the files, so that another model never reuses this one's cached states
    model.weights_digest = xxhash.xxh3_128_digest(f"loader {LOADER_VERSION}".encode() + files_digest(files))
    # an inference engine's weights never need gradients; training builds its own model
    return model.eval().requires_grad_(False)


def _meta_model(folder: Path, cfg: ModelConfig) -> HybridModel:
    """The model `cfg` describes, on the meta device (no memory, no init): a ConfigError for sizes
    no model can have."""
    try:
        with torch.device("meta"), _no_init():
            return HybridModel(cfg)
    except (RuntimeError, ValueError, TypeError, ArithmeticError) as e:
        raise ConfigError(f"{folder / 'config.json'} describes no model hcw can build ({type(e).__name__}: {e})") from None


_INITS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
          "xavier_normal_", "zeros_", "ones_", "constant_", "orthogonal_")


@contextlib.contextmanager
def _no_init():
    """Modules built without initialising their parameters: the checkpoint replaces every one. On
    the meta device an init is an empty op, but it runs through torch._refs, whose first use
    imports TorchDynamo: about 1 s of every start, for nothing (what transformers'
    `no_init_weights` does too)."""
    saved = {name: getattr(torch.nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


# DeepSeek-V4 keeps these in float32 whatever the model dtype: norms, hyper-connection weights,
# attention sinks, compressor position biases and the router's correction bias
_V4_FP32 = re.compile(r"(norm\.weight|hc_(attn|ffn)\.|hc_head\.|attn_sink|\.ape|gate\.bias)")


def _param_dtype(cfg: ModelConfig, name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    if not t.is_floating_point():
        return t.dtype
    if cfg.is_v4 and _V4_FP32.search(name):
        return torch.float32
    return dtype


# checkpoint name -> ours, for names that differ by more than the family prefix
_RENAMES = (
    (re.compile(r"^(layers\.\d+)\.hc_(attn|ffn)_(fn|base|scale)$"), r"\1.hc_\2.\3"),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head.\1"),
)
_EXPERT = re.compile(r"(layers\.\d+\.(?:mlp|ffn)\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder (a sharded index's, or every one), each checked to be
    one: a truncated or foreign file is a WeightsError naming it, before anything is read."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            if not all(isinstance(name, str) for name in files):
                raise TypeError("a weight_map value is not a file name")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightsError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from None
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{folder} has no .safetensors weights")
    out = []
    for name in files:
        shard = folder / name
        if not shard.is_file():
            raise WeightsError(f"shard {name} listed in the index is missing from {folder}")
        try:
            header_digest(shard)
        except (OSError, ValueError) as e:
            raise WeightsError(f"{shard}: {e}") from None
        out.append(shard)
    return out


def _read_safetensors(files: list[Path], files_open: contextlib.ExitStack
                      ) -> tuple[dict[str, torch.Tensor], list[tuple[int, int]]]:
    """Every tensor of the files (views of their mappings), and the mappings' address ranges; the
    files are closed when `files_open` closes (the mappings live on in the views kept)."""
    out: dict[str, torch.Tensor] = {}
    mapped: list[tuple[int, int]] = []
    for shard in files:
        try:
            f = files_open.enter_context(safe_open(str(shard), framework="pt"))
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise WeightsError(f"{shard} cannot be read as safetensors: {e}") from None
        mapped += file_ranges(shard, list(tensors.values()))
        out.update(tensors)
    return out, mapped


def _to_our_names(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    prefix = cfg.weight_prefix
    for key, t in tensors.items():
        if key.startswith(IGNORED_PREFIXES):
            continue
        if key.startswith(prefix):
            name = key[len(prefix):]
        elif key in ("lm_head.weight", "head.weight"):
            name = "lm_head.weight"
        else:
            raise WeightsError(f"unexpected tensor {key!r} (expected names under {prefix!r})")
        for pattern, repl in _RENAMES:
            name = pattern.sub(repl, name)
        m = _EXPERT.fullmatch(name)
        if m:
            experts.setdefault((m[1], int(m[2])), {})[_EXPERT_PART[m[3]]] = t
            continue
        out[name] = t
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    _stack_experts(cfg, experts, out)
    if cfg.fused_gdn_projection:
        _split_fused_gdn(cfg, out)
    return out


def _stack_experts(cfg: ModelConfig, experts: dict, out: dict[str, torch.Tensor]) -> None:
    by_layer: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for (base, e), parts in experts.items():
        by_layer.setdefault(base, {})[e] = parts
    for base, per_expert in by_layer.items():
        names = {"gate": "w1", "up": "w3", "down": "w2"} if cfg.is_v4 else \
            {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
        missing = [f"{cfg.weight_prefix}{base}.{e}.{names[p]}.weight" for e in range(cfg.num_experts)
                   for p in ("gate", "up", "down") if p not in per_expert.get(e, {})]
        if missing:
            raise WeightsError(f"missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        extra = sorted(set(per_expert) - set(range(cfg.num_experts)))
        if extra:
            raise WeightsError(f"unexpected tensor for expert {extra[0]} of {cfg.weight_prefix}{base} "
                               f"(config has {cfg.num_experts} experts)")
        order = range(cfg.num_experts)
        out[f"{base}.gate_up_proj"] = torch.stack(
            [torch.cat([per_expert[e]["gate"], per_expert[e]["up"]], 0) for e in order])
        out[f"{base}.down_proj"] = torch.stack([per_expert[e]["down"] for e in order])


def _split_fused_gdn(cfg: ModelConfig, out: dict[str, torch.Tensor]) -> None:
    nk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // nk
    h = cfg.hidden_size
    for name in [n for n in out if n.endswith("linear_attn.in_proj_qkvz.weight")]:
        base = name[: -len("in_proj_qkvz.weight")]
        w = out.pop(name)
        if w.shape != (nk * (2 * dk + 2 * r * dv), h):
            raise WeightsError(f"tensor {cfg.weight_prefix}{name!r} has shape {tuple(w.shape)}, "
                               f"expected {(nk * (2 * dk + 2 * r * dv), h)}")
        q, k, v, z = w.view(nk, 2 * dk + 2 * r * dv, h).split([dk, dk, r * dv, r * dv], dim=1)
        out[base + "in_proj_qkv.weight"] = torch.cat([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)])
        out[base + "in_proj_z.weight"] = z.reshape(-1, h)
        ba_name = base + "in_proj_ba.weight"
        if ba_name not in out:
            raise WeightsError(f"missing tensor {cfg.weight_prefix + ba_name!r}")
        ba = out.pop(ba_name)
        if ba.shape != (2 * nk * r, h):
            raise WeightsError(f"tensor {cfg.weight_prefix + ba_name!r} has shape {tuple(ba.shape)}, "
                               f"expected {(2 * nk * r, h)}")
        b, a = ba.view(nk, 2 * r, h).split([r, r], dim=1)
        out[base + "in_proj_b.weight"] = b.reshape(-1, h)
        out[base + "in_proj_a.weight"] = a.reshape(-1, h)


def _transposed_names(model: HybridModel) -> set[str]:
    """The weights that are stored [in, out] on the CPU when they are fp32 (a transposed view of a
    contiguous copy): every projection's. On the CPU a one-token fp32 matmul reads such a weight
    ~1.5x faster: the decode step's projections, 1.51 -> 1.04 ms for this repo's benchmark model
    (30 MB of weights: decode after 1K 3.3 -> 2.5 ms, and [in, out] is what `direct.Linear`
    splits across threads). MKL's prefill GEMMs lost ~3-5% on it; prefill now goes through oneDNN
    (`direct.linear`), which reads both layouts at the same speed. fp16 and bf16 are left alone:
    their CPU kernels are slower on this layout (fp16 many times over: 147 us -> 8.2 ms a row)."""
    return {f"{name}.weight" for name, mod in model.named_modules() if isinstance(mod, nn.Linear)}


# bytes of weights built between two give-backs of the file pages their sources were read from
_DROP_EVERY = 64 << 20


class _Dropper:
    """Gives the mapped files' pages back after every _DROP_EVERY bytes built from them."""

    def __init__(self, mapped: list[tuple[int, int]]):
        self.mapped, self.built = mapped, 0

    def add(self, nbytes: int) -> None:
        self.built += nbytes
        if self.built >= _DROP_EVERY:
            self.flush()

    def flush(self) -> None:
        drop_resident(self.mapped)
        trim_heap()
        self.built = 0


def _final_layout(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str,
                  transposed: set[str], dropper: _Dropper) -> None:
    """Each tensor in its dtype, on its device and (fp32 projections on the CPU) stored [in, out]:
    itself when it already is, else one copy made a block of rows at a time, the file pages read
    for each block given back as it goes, so that a load never holds much more than the weights."""
    for k, v in state.items():
        dt = _param_dtype(cfg, k, v, dtype)
        flip = k in transposed and v.dim() == 2 and dt == torch.float32
        if not flip and v.dtype == dt and v.device == torch.device(device):
            continue
        w = torch.empty(v.shape[::-1] if flip else v.shape, dtype=dt, device=device)
        w = w.t() if flip else w
        if v.dim() == 0:
            w.copy_(v)
        else:
            step = max(1, _DROP_EVERY // max(1, v[0].nbytes))
            for lo in range(0, len(v), step):
                w[lo:lo + step].copy_(v[lo:lo + step])
                dropper.add(v[lo:lo + step].nbytes)
        state[k] = w
    dropper.flush()


# float32 bytes of the rows quantised at once: between two blocks the file pages read are given
# back; where the C quantiser does not apply (CUDA, fp16), q8.quantise makes a few float32
# temporaries of the block, which sit on top of the int8 weights and those pages at the load's
# peak (counted in the source's bytes, a bf16 block's temporaries were twice as large)
_QUANTISE_BLOCK = 8 << 20


def _quantise(state: dict[str, torch.Tensor], names, fused: dict[str, list[tuple[str, int]]], device: str,
              dropper: _Dropper, cfg: ModelConfig, done=None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The weights `names` taken out of `state` and quantised (kernels/q8) from the checkpoint's
    values, a block of rows at a time, the file pages read for each block given back as it goes:
    name -> (q, scales). A fused weight (a name in `fused`, our name -> its parts) is quantised
    from its parts into its rows (each row has its own scales, so the result is the same) and
    never built in float. A weight that is not finite is a WeightsError naming it."""
    out = {}
    for k in names:
        pieces = [(part, state.pop(part)) for part, _ in fused[k]] if k in fused else [(k, state.pop(k))]
        n, width = sum(len(v) for _, v in pieces), pieces[0][1].shape[1]
        q = torch.empty(n, width, dtype=torch.int8, device=device)
        scales = torch.empty(n, q8.groups(width), dtype=torch.float32, device=device)
        row = 0
        while pieces:
            name, v = pieces.pop(0)
            step = max(1, _QUANTISE_BLOCK // (4 * max(1, width)))  # rows of float32 temporaries
            for lo in range(0, len(v), step):
                hi = min(len(v), lo + step)
                try:
                    # (one C pass on the CPU, kernels/native/quantise_q8.c; the torch reference elsewhere)
                    native_quantise.quantise(v[lo:hi].to(device), out=(q[row + lo:row + hi], scales[row + lo:row + hi]))
                except ValueError as e:
                    raise WeightsError(f"tensor {cfg.weight_prefix + name!r} cannot be held as int8: {e}") from None
                dropper.add(v[lo:hi].nbytes)
            row += len(v)
            del v
        out[k] = (q, scales)
        if done is not None:  # (one call a weight: `save_int8`'s progress)
            done()
    dropper.flush()
    return out


def _fused_modules(model: HybridModel):
    """(our fused name, [(checkpoint sibling name, rows)]) for every FusedLinear, weight and bias."""
    for name, mod in model.named_modules():
        if isinstance(mod, FusedLinear):
            parent = name.rsplit(".", 1)[0]
            for attr in ("weight", "bias") if mod.bias is not None else ("weight",):
                yield f"{name}.{attr}", [(f"{parent}.{part}.{attr}", rows) for part, rows in mod.parts.items()]


def _fuse(model: HybridModel, state: dict[str, torch.Tensor], dropper: _Dropper, done=()) -> None:
    """Each fused weight made from its parts, which are dropped (and the file pages they were read
    from given back); those in `done` are already built (int8, from their parts)."""
    for fused, parts in _fused_modules(model):
        if fused in done:
            continue
        state[fused] = torch.cat([state.pop(part) for part, _ in parts])
        dropper.add(state[fused].nbytes)
    dropper.flush()


def checkpoint_layout(model: HybridModel) -> dict[str, torch.Tensor]:
    """Our state dict with fused projections split back into the checkpoint's tensors."""
    state = dict(model.state_dict())
    for fused, parts in _fused_modules(model):
        pieces = state.pop(fused).split([rows for _, rows in parts])
        state.update({part: piece for (part, _), piece in zip(parts, pieces)})
    return state


def _check(model: HybridModel, state: dict[str, torch.Tensor],
           held: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
    """`state` holds every tensor the model needs at its shape, nothing else; `held` (a stored int8
    folder's, our names) the int8 weights, whole, at theirs: every mismatch a WeightsError naming
    the tensor as its file does."""
    cfg = model.config
    held = held or {}
    ours = model.state_dict()
    expected = {k: tuple(v.shape) for k, v in ours.items()}
    for fused, parts in _fused_modules(model):
        shape = expected.pop(fused)
        if fused in held:
            expected[fused] = shape
        else:
            expected.update({part: (rows, *shape[1:]) for part, rows in parts})
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    floating = {k: v.is_floating_point() for k, v in ours.items()}
    for name, (q, scales) in held.items():
        n, k = expected.pop(name)
        for part, t, want in (("q", q, (torch.int8, (n, k))), ("scales", scales, (torch.float32, (n, q8.groups(k))))):
            if (t.dtype, tuple(t.shape)) != want:
                raise WeightsError(f"tensor {f'{STORED_INT8}{name}.{part}'!r} is {t.dtype} {tuple(t.shape)}, "
                                   f"expected {want[0]} {want[1]}")
        if not torch.isfinite(scales).all():  # q8.quantise never makes one: the file is damaged
            raise WeightsError(f"tensor {f'{STORED_INT8}{name}.scales'!r} holds a value that is not finite")

    def ckpt_name(ours: str) -> str:
        if held:
            return STORED + ours
        return ours if ours == "lm_head.weight" else cfg.weight_prefix + ours

    missing = sorted(set(expected) - set(state))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightsError(f"missing tensor {ckpt_name(missing[0])!r}{more}")
    extra = sorted(set(state) - set(expected))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise WeightsError(f"unexpected tensor {ckpt_name(extra[0])!r}{more}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise WeightsError(f"tensor {ckpt_name(name)!r} has shape {tuple(state[name].shape)}, expected {shape}")
        if state[name].is_floating_point() != floating.get(name, True):
            raise WeightsError(f"tensor {ckpt_name(name)!r} is {state[name].dtype}, expected "
                               f"{'a float' if floating.get(name, True) else 'an integer'} dtype")


def _stored_layout(files: list[Path]) -> None:
    """A stored folder's files say they hold STORED_LAYOUT (another hcw's `quantise` may have
    written another layout under the same names): a WeightsError saying so otherwise."""
    for shard in files:
        try:
            with safe_open(str(shard), framework="pt") as f:
                layout = (f.metadata() or {}).get("hcw")
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise WeightsError(f"{shard} cannot be read as safetensors: {e}") from None
        if layout != STORED_LAYOUT:
            raise WeightsError(f"{shard} holds int8 weights in layout {layout!r}, not {STORED_LAYOUT!r} "
                               "(written by another hcw version): run `hcw quantise` on the model again")


def _stored(raw: dict[str, torch.Tensor], folder: Path, int8_names) -> tuple[dict, dict] | None:
    """None for a checkpoint; for a folder save_int8 wrote, (the float tensors by our names, our
    name -> (q, scales) of every weight `int8_names` lists). Such a folder loads only as int8 (None
    for int8_names: another dtype was asked), and holds every weight int8 that it should."""
    ours = [k for k in raw if k.startswith(STORED)]
    if not ours:
        return None
    if len(ours) != len(raw):
        other = next(k for k in raw if not k.startswith(STORED))
        raise WeightsError(f"{folder} mixes the int8 tensors `hcw quantise` writes with a checkpoint's ({other!r})")
    if int8_names is None:
        raise WeightsError(f"{folder} holds int8 weights (written by `hcw quantise`): load it with --dtype int8")
    state, parts = {}, {}
    for key, t in raw.items():
        if key.startswith(STORED_INT8):
            name, _, part = key[len(STORED_INT8):].rpartition(".")
            if part not in ("q", "scales") or not name:
                raise WeightsError(f"unexpected tensor {key!r}")
            parts.setdefault(name, {})[part] = t
        else:
            state[key[len(STORED):]] = t
    for name in int8_names:
        for part in ("q", "scales"):
            if part not in parts.get(name, {}):
                raise WeightsError(f"missing tensor {f'{STORED_INT8}{name}.{part}'!r}")
    extra = sorted(set(parts) - set(int8_names))
    if extra:
        raise WeightsError(f"unexpected tensor {f'{STORED_INT8}{extra[0]}.q'!r} (not a weight int8 holds)")
    return state, {name: (p["q"], p["scales"]) for name, p in parts.items()}


def stored_format(folder: Path) -> str | None:
    """"int8" for a folder save_int8 wrote, else None (a checkpoint, or weights that cannot be
    read: the load says why). Reads the files' headers only."""
    try:
        for shard in _weight_files(folder):
            with safe_open(str(shard), framework="pt") as f:
                if any(key.startswith(STORED) for key in f.keys()):
                    return "int8"
    except (WeightsError, SafetensorError, OSError, ValueError, RuntimeError):
        return None
    return None


def save_int8(path: str | Path, out: str | Path, progress=None) -> dict:
    """Write the model at `path` (a folder or a built-in name) with its int8 weights (what
    `--dtype int8` quantises at load) as the folder `out`, which must not exist or be empty:
    model.safetensors in the stored layout (module docstring) beside a copy of every other file of
    the source (config, tokenizer). `progress` (workbench.progress.Steps' shape: total, doing,
    done) hears of each weight quantised and then of the write. Returns the bytes written and the
    source's."""
    from safetensors.torch import save_file

    folder, out = resolve_model(path), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise WeightsError(f"{out} already exists and is not an empty folder")
    cfg = ModelConfig.from_folder(folder)
    model = _meta_model(folder, cfg)
    files = _weight_files(folder)
    with contextlib.ExitStack() as files_open:
        raw, mapped = _read_safetensors(files, files_open)
        if any(k.startswith(STORED) for k in raw):
            raise WeightsError(f"{folder} already holds int8 weights (written by `hcw quantise`)")
        source = sum(t.nbytes for t in raw.values())
        state = _to_our_names(cfg, raw)
        del raw
        _check(model, state)
        names = list(int8_weights(model))
        if progress is not None:
            progress.total(len(names) + 1)
            progress.doing("quantising")
        held = _quantise(state, names, dict(_fused_modules(model)), "cpu", _Dropper(mapped), cfg,
                         done=None if progress is None else progress.done)
        if progress is not None:
            progress.doing(f"writing {out / 'model.safetensors'}")
        # (copies: the file's views share its mapping's storage, which safetensors will not write)
        tensors = {STORED + k: v.clone() for k, v in state.items()}
        for name, (q, scales) in held.items():
            tensors[f"{STORED_INT8}{name}.q"], tensors[f"{STORED_INT8}{name}.scales"] = q, scales
        del state, held
        made = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        partial = out / ".model.safetensors.partial"
        try:
            save_file(tensors, str(partial), metadata={"format": "pt", "hcw": STORED_LAYOUT})
            written = sum(t.nbytes for t in tensors.values())
            for p in sorted(folder.iterdir()):  # config, tokenizer, chat template: the model's, unchanged
                if p.is_file() and p.suffix != ".safetensors" and p.name != "model.safetensors.index.json":
                    shutil.copy2(p, out / p.name)
            partial.replace(out / "model.safetensors")  # last: a folder without it is not a model
            if progress is not None:
                progress.done()
        except BaseException:  # a full disk, an interrupt: nothing this call wrote is left behind
            for p in out.iterdir():  # (out was empty or new)
                p.unlink()
            if made:
                out.rmdir()
            raise
    return {"folder": str(out), "bytes": written, "source_bytes": source}


def save_model(model: HybridModel, raw_config: dict, folder: str | Path) -> Path:
    """Write `model` as a folder `load_model` reads: config.json + model.safetensors in the
    checkpoint layout (fused projections split back into their checkpoint tensors)."""
    from safetensors.torch import save_file

    if any(getattr(mod, "int8", False) for mod in model.modules()):
        raise ValueError("save_model: an int8 model cannot be saved (its checkpoint is its float weights); "
                         "load them in another dtype")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    tensors = {}
    for name, t in checkpoint_layout(model).items():
        if name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                tensors[name] = t.detach().contiguous()
        else:
            tensors[cfg.weight_prefix + name] = t.detach().contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
    return folder

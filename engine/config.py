"""Model and engine configuration.

`ModelConfig` is read once from a model folder's `config.json`; the per-layer kind is data
(`layer_types`), never a subclass. What the user chooses at run time is engine/engine_config.py's
`EngineConfig`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

# model_type -> family; the wrapper types keep their text model under `text_config`
# hcw_hybrid is hcw's own: any mix of the layer kinds, its config.json spelled in ModelConfig's field names
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next", "deepseek_v4", "hcw_hybrid")
LAYER_KINDS = ("linear_attention", "full_attention", "sliding_attention", "compressed_sparse_attention",
               "heavily_compressed_attention")
# the DeepSeek-V4 kinds: every one has a sliding-window branch, two add a compressor
COMPRESSED_KINDS = ("compressed_sparse_attention", "heavily_compressed_attention")
V4_KINDS = ("sliding_attention", *COMPRESSED_KINDS)

# int8 names a weights format rather than a compute dtype: the projections held as int8, everything
# else and all computation float32 (engine/model/int8.py)
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "int8": torch.int8}


class ConfigError(ValueError):
    """A config.json that hcw cannot run."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """The dtype a model loads in (torch.int8: int8 weights, float32 compute)."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of fp32, bf16, fp16, int8")
    return _DTYPES[name]


def compute_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The dtype activations, states and the unquantised weights have under a load dtype."""
    dtype = parse_dtype(dtype)
    return torch.float32 if dtype is torch.int8 else dtype


@dataclass(frozen=True)
class RopeSpec:
    """One rotary table: base, and YaRN scaling when `yarn_factor` is set."""

    theta: float = 10000.0
    yarn_factor: float | None = None
    yarn_original_max: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    @classmethod
    def from_dict(cls, d: dict) -> RopeSpec:
        kind = d.get("rope_type", d.get("type", "default"))
        if kind == "default":
            return cls(theta=float(d.get("rope_theta", 10000.0)))
        if kind != "yarn":
            raise ConfigError(f"rope type {kind!r} is not supported (default, yarn)")
        return cls(theta=float(d.get("rope_theta", 10000.0)), yarn_factor=float(d["factor"]),
                   yarn_original_max=int(d["original_max_position_embeddings"]),
                   beta_fast=float(d.get("beta_fast") or 32), beta_slow=float(d.get("beta_slow") or 1),
                   attention_factor=float(d.get("attention_factor", 1.0)), truncate=bool(d.get("truncate", True)))


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    # full attention
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    # gated deltanet
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # mixture of experts (qwen3_next); num_experts == 0 means dense MLP everywhere
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # checkpoint layout
    weight_prefix: str = "model."
    # qwen3_next stores q/k/v/z and b/a in one fused, per-key-head interleaved projection
    fused_gdn_projection: bool = False
    # deepseek_v4: sliding / compressed-sparse / heavily-compressed attention, hyper-connections
    sliding_window: int = 0
    csa_rate: int = 4
    hca_rate: int = 128
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    q_lora_rank: int = 0
    o_groups: int = 1
    o_lora_rank: int = 0
    hc_mult: int = 1  # 1 = a plain residual stream; > 1 = hyper-connections with that many streams
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    mlp_layer_types: tuple[str, ...] = ()  # per layer: "dense" | "moe" | "hash_moe" (v4 routing)
    scoring_func: str = "softmax"
    routed_scaling_factor: float = 1.0
    swiglu_limit: float | None = None
    rope_main: RopeSpec = RopeSpec()
    rope_compress: RopeSpec = RopeSpec()
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries, "
                              f"num_hidden_layers is {self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - set(LAYER_KINDS))
        if unknown:
            raise ConfigError(f"unknown layer types {unknown}; supported: {list(LAYER_KINDS)}")
        if "full_attention" in self.layer_types and self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if "linear_attention" in self.layer_types and self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError("num_experts_per_tok must be in 1..num_experts")
        if any(k in V4_KINDS for k in self.layer_types):
            self._check_v4()

    def _check_v4(self) -> None:
        kinds = set(self.layer_types)
        if self.sliding_window <= 0:
            raise ConfigError(f"sliding_window must be > 0, got {self.sliding_window}")
        for name, kind, rate in (("compressed_sparse_attention", "compressed_sparse_attention", self.csa_rate),
                                 ("heavily_compressed_attention", "heavily_compressed_attention", self.hca_rate)):
            if kind in kinds and rate < 2:
                raise ConfigError(f"compress rate for {name} must be >= 2, got {rate}")
        if {"compressed_sparse_attention", "heavily_compressed_attention"} <= kinds and self.hca_rate % self.csa_rate:
            # nested windows: every heavily-compressed window closes on a compressed-sparse boundary, so one
            # segment boundary never splits the two kinds' windows differently
            raise ConfigError(f"the heavily-compressed rate ({self.hca_rate}) must be a multiple of the "
                              f"compressed-sparse rate ({self.csa_rate})")
        if "compressed_sparse_attention" in kinds:
            most = self.max_position_embeddings // self.csa_rate
            if not 1 <= self.index_topk <= most:
                raise ConfigError(f"index_topk must be in 1..{most} (the most compressed entries a "
                                  f"{self.max_position_embeddings}-token context has), got {self.index_topk}")
            if self.index_n_heads < 1 or self.index_head_dim < self.rotary_dim:
                raise ConfigError("index_n_heads must be >= 1 and index_head_dim >= the rotary dim")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError("num_attention_heads must be a multiple of o_groups")
        if self.mlp_layer_types and len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ConfigError("mlp_layer_types needs one entry per layer")

    def compress_rate(self, kind: str) -> int:
        return {"compressed_sparse_attention": self.csa_rate, "heavily_compressed_attention": self.hca_rate}[kind]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, idx: int) -> bool:
        return (self.num_experts > 0 and idx not in self.mlp_only_layers
                and (idx + 1) % self.decoder_sparse_step == 0)

    @property
    def is_v4(self) -> bool:
        return self.model_type == "deepseek_v4"

    @property
    def norm_unit_offset(self) -> bool:
        # Qwen stores norm weights around 0 (scale = 1 + w); DeepSeek-V4 stores the scale itself
        return not self.is_v4

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        """A config.json body; anything malformed in it (a value of the wrong type, a list where
        an object belongs) is a ConfigError naming it."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config.json must be a JSON object, got a JSON {type(raw).__name__}")
        try:
            return cls._from_raw(raw)
        except ConfigError:
            raise
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, ArithmeticError) as e:
            raise ConfigError(f"config.json has a bad value ({type(e).__name__}: {e})") from None

    @classmethod
    def _from_raw(cls, raw: dict) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"unsupported model_type {model_type!r}; "
                              f"supported families: {', '.join(SUPPORTED_MODEL_TYPES)}")
        text = raw
        prefix = "model."
        if model_type == "qwen3_5":
            if "text_config" not in raw:
                raise ConfigError("qwen3_5 config.json has no text_config")
            # the vision tower is ignored: hcw runs the language model only
            text = {**raw["text_config"]}
            text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
            prefix = "model.language_model."
        if model_type == "deepseek_v4":
            return cls._from_v4(raw)
        if model_type == "hcw_hybrid":
            return cls._from_fields(raw)
        return cls._from_text(model_type, text, prefix)

    @classmethod
    def _from_fields(cls, raw: dict) -> ModelConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(k for k in raw if k not in names and not k.startswith("hcw_"))
        if unknown:
            raise ConfigError(f"unknown hcw_hybrid config keys {unknown}")
        kw = {k: v for k, v in raw.items() if k in names and k != "extra"}
        for key in ("layer_types", "mlp_only_layers", "mlp_layer_types", "eos_token_ids"):
            if key in kw:
                kw[key] = tuple(kw[key])
        for key in ("rope_main", "rope_compress"):
            if key in kw:
                kw[key] = RopeSpec(**kw[key])
        kw["extra"] = {k: v for k, v in raw.items() if k.startswith("hcw_")}
        try:
            return cls(**kw)
        except TypeError as e:
            raise ConfigError(f"bad hcw_hybrid config: {e}") from None

    def to_dict(self) -> dict:
        """The hcw_hybrid config.json body for this config."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        out["rope_main"], out["rope_compress"] = asdict(self.rope_main), asdict(self.rope_compress)
        return {**{k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}, **self.extra}

    @classmethod
    def _from_v4(cls, t: dict) -> ModelConfig:
        try:
            n_layers = int(t["num_hidden_layers"])
            hidden = int(t["hidden_size"])
            vocab = int(t["vocab_size"])
        except KeyError as e:
            raise ConfigError(f"config.json is missing {e.args[0]!r}") from None
        layer_types = t.get("layer_types") or (
            ["heavily_compressed_attention"] * min(n_layers, 2)
            + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(n_layers - 2)])
        n_hash = int(t.get("num_hash_layers", 3))
        mlp_types = t.get("mlp_layer_types") or (["hash_moe"] * min(n_layers, n_hash) + ["moe"] * (n_layers - n_hash))
        rates = t.get("compress_rates") or {}
        head_dim = int(t.get("head_dim", 512))
        partial = t.get("partial_rotary_factor")
        if partial is None:
            partial = t["qk_rope_head_dim"] / head_dim if "qk_rope_head_dim" in t else 64 / 512
        rope = t.get("rope_parameters") or {}
        if isinstance(rope.get("main"), dict):
            main, compress = rope["main"], rope["compress"]
        else:
            main = {"rope_type": "default", "rope_theta": t.get("rope_theta", 10000.0)}
            compress = {**rope, "rope_theta": t.get("compress_rope_theta", 160000.0)}
        eos = t.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type="deepseek_v4", vocab_size=vocab, hidden_size=hidden,
            intermediate_size=int(t.get("moe_intermediate_size", 2048)),
            num_hidden_layers=n_layers, layer_types=tuple(layer_types),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
            max_position_embeddings=int(t.get("max_position_embeddings", 1048576)),
            num_attention_heads=int(t.get("num_attention_heads", 64)), num_key_value_heads=1,
            head_dim=head_dim, partial_rotary_factor=float(partial),
            num_experts=int(t.get("n_routed_experts", 256)), num_experts_per_tok=int(t.get("num_experts_per_tok", 6)),
            moe_intermediate_size=int(t.get("moe_intermediate_size", 2048)),
            shared_expert_intermediate_size=int(t.get("moe_intermediate_size", 2048)),
            sliding_window=int(t.get("sliding_window", 128)),
            csa_rate=int(rates.get("compressed_sparse_attention", t.get("compress_rate_csa", 4))),
            hca_rate=int(rates.get("heavily_compressed_attention", t.get("compress_rate_hca", 128))),
            index_n_heads=int(t.get("index_n_heads", 64)), index_head_dim=int(t.get("index_head_dim", 128)),
            index_topk=int(t.get("index_topk", 512)), q_lora_rank=int(t.get("q_lora_rank", 1024)),
            o_groups=int(t.get("o_groups", 8)), o_lora_rank=int(t.get("o_lora_rank", 1024)),
            hc_mult=int(t.get("hc_mult", 4)), hc_sinkhorn_iters=int(t.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(t.get("hc_eps", 1e-6)), mlp_layer_types=tuple(mlp_types),
            scoring_func=t.get("scoring_func", "sqrtsoftplus"),
            routed_scaling_factor=float(t.get("routed_scaling_factor", 1.5)),
            swiglu_limit=t.get("swiglu_limit", 10.0),
            rope_main=RopeSpec.from_dict(main), rope_compress=RopeSpec.from_dict(compress),
            weight_prefix="model.", eos_token_ids=eos_ids, bos_token_id=t.get("bos_token_id"),
            extra={k: v for k, v in t.items() if k.startswith("hcw_")},
        )

    @classmethod
    def _from_text(cls, model_type: str, t: dict, prefix: str) -> ModelConfig:
        try:
            n_layers = int(t["num_hidden_layers"])
            hidden = int(t["hidden_size"])
            vocab = int(t["vocab_size"])
        except KeyError as e:
            raise ConfigError(f"config.json is missing {e.args[0]!r}") from None
        interval = int(t.get("full_attention_interval", 4))
        layer_types = t.get("layer_types") or [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", t.get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ConfigError(f"rope type {rope_type!r} is not supported")
        eos = t.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        n_heads = int(t.get("num_attention_heads", 16))
        return cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(t.get("intermediate_size", 4 * hidden)),
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
            max_position_embeddings=int(t.get("max_position_embeddings", 32768)),
            hidden_act=t.get("hidden_act", "silu"),
            num_attention_heads=n_heads,
            num_key_value_heads=int(t.get("num_key_value_heads", n_heads)),
            head_dim=int(t.get("head_dim") or hidden // n_heads),
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            attention_bias=bool(t.get("attention_bias", False)),
            linear_conv_kernel_dim=int(t.get("linear_conv_kernel_dim", 4)),
            linear_key_head_dim=int(t.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(t.get("linear_value_head_dim", 128)),
            linear_num_key_heads=int(t.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(t.get("linear_num_value_heads", 32)),
            num_experts=int(t.get("num_experts", 0)) if model_type == "qwen3_next" else 0,
            num_experts_per_tok=int(t.get("num_experts_per_tok", 0)),
            moe_intermediate_size=int(t.get("moe_intermediate_size", 0)),
            shared_expert_intermediate_size=int(t.get("shared_expert_intermediate_size", 0)),
            norm_topk_prob=bool(t.get("norm_topk_prob", True)),
            decoder_sparse_step=int(t.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(t.get("mlp_only_layers") or ()),
            weight_prefix=prefix,
            fused_gdn_projection=model_type == "qwen3_next",
            eos_token_ids=eos_ids,
            bos_token_id=t.get("bos_token_id"),
            extra={k: v for k, v in t.items() if k.startswith("hcw_")},
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{folder} has no config.json")
        try:
            raw = json.loads(path.read_text())
        except UnicodeDecodeError:
            raise ConfigError(f"{path} is not text") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(raw)

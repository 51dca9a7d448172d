"""`--dtype int8`: which weights a model holds as int8 (kernels/q8's format: a float32 scale per
row and group of 32 columns) and what that costs.

Every projection of the decoder (attention, GDN, MLP, V4's) and the LM head is quantised at load
from the checkpoint's own weights and held only as int8 (`direct.Linear.quantise`). Everything
else stays float32, and so does all computation: an untied embedding, norms, convolutions, GDN's
decay parameters, hyper-connections, MoE experts (stacked tensors, not Linears). A tied embedding
is one int8 table (q8_0's way): the lookup dequantises the rows it takes and the LM head reads the
same int8 rows and scales, so a 248K x 1024 vocabulary holds 0.26 GB, not 1 GB of float32 read at
every decode step. Kept float32 on purpose: V4's `wo_a` (read as a grouped tensor, not through
`Linear.forward`) and Qwen's MoE router and shared-expert gate (a discrete choice of experts that
int8 rounding could flip; small). On the CPU a decode step's one-row products take the native int8
GEMV, a prefill's the reference's dequantise-a-block-and-multiply. (So does a batched decode
step's head of a few rows: the whole table dequantised a block at a time, every step; a native
product of a few rows, each weight read once, is not written yet.)
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.direct import Linear
from engine.model.mlp import SparseMoE
from engine.model.v4_attention import V4Attention
from kernels.q8 import groups


def int8_linears(model: nn.Module) -> dict[str, Linear]:
    """name -> module of every Linear that `--dtype int8` holds as int8 (the rule above); works on
    a model on the meta device too."""
    cfg: ModelConfig = model.config
    modules = dict(model.named_modules())
    out = {}
    for name, mod in modules.items():
        if not isinstance(mod, Linear):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = modules[parent_name]
        if isinstance(parent, SparseMoE) or (isinstance(parent, V4Attention) and attr == "wo_a"):
            continue
        if name == "lm_head" and cfg.tie_word_embeddings:
            continue
        out[name] = mod
    return out


def int8_weights(model: nn.Module) -> dict[str, nn.Module]:
    """Checkpoint-side name -> module of every weight `--dtype int8` quantises: the Linears of
    `int8_linears`, and a tied embedding's table ("embed_tokens.weight", which the LM head then
    shares); works on a model on the meta device too."""
    out: dict[str, nn.Module] = {f"{name}.weight": mod for name, mod in int8_linears(model).items()}
    if model.config.tie_word_embeddings:
        out["embed_tokens.weight"] = model.embed_tokens
    return out


def int8_bytes(shape: torch.Size | tuple[int, int]) -> int:
    """Bytes of one int8 weight [N, K]: N*K int8 and N*ceil(K / 32) float32 scales."""
    n, k = shape
    return n * k + 4 * n * groups(k)


def weights_format(model: nn.Module) -> str:
    """The number format of the model's weights, as the CLI names it: int8 (some held as int8),
    else its dtype: fp32, bf16, fp16."""
    if any(getattr(mod, "int8", False) for mod in model.modules()):
        return "int8"
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(model.dtype, str(model.dtype))

"""Train hcw-tiny: an hcw_hybrid with every layer kind, on the synthetic recall data, on CPU.

Seeded and reproducible; stops at a step count or a time budget, whichever comes first; logs the
loss curve as JSON lines next to the weights; writes a model folder `engine.load_model` reads
(config.json + model.safetensors, byte tokenizer).

    hcw train-tiny --out models/hcw-tiny          # 2,200 steps, about 80 minutes on 2 cores
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.model.gdn import GatedDeltaNet
from engine.model.hybrid import HybridModel
from engine.model.loader import load_model, save_model
from engine.model.random_init import hcw_hybrid_dict, init_random, qwen3_5_text_dict
from engine.tokenizer import ByteTokenizer
from workbench.tiny.data import batch

# GDN and full attention for recall, sliding / compressed-sparse / heavily-compressed for every
# state object; attention layers use partial RoPE (a quarter of each head), the rest is position-free.
# The window (16) and the indexer's top-k (4 entries of 4 tokens) are kept short on purpose: with a
# 64-token window the short curriculum phases were solved through the window (and an untrained
# indexer selecting everything), and recall collapsed once contexts outgrew them (measured: answer
# loss 0.1 at 128 tokens, 1.3 from the first steps at 256); full attention must learn retrieval.
TINY_LAYERS = ("linear_attention", "sliding_attention", "linear_attention", "compressed_sparse_attention",
               "linear_attention", "full_attention", "heavily_compressed_attention", "full_attention")


@dataclass(frozen=True)
class TrainConfig:
    hidden: int = 128
    seq_len: int = 2048  # the last phase's length; earlier phases halve it and double the batch
    batch_size: int = 3
    halvings: int = 5  # curriculum: seq_len/32, /16, /8, /4, /2, then seq_len, an equal share of the run each
    max_questions: int = 6
    text_weight: float = 0.1  # next-token loss on the rest of the text, beside the answers' loss
    tasks: tuple[str, ...] = ("table", "table", "kv", "multikey", "variables")  # dense recall weighted double
    steps: int = 2200  # the run's length; `minutes` is a safety bound (a slow machine ends early)
    minutes: float = 88.0
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.05
    seed: int = 0
    log_every: int = 10
    layers: tuple[str, ...] = TINY_LAYERS
    # hcw_hybrid: hcw-tiny, every layer kind (`layers`); qwen3_5: a Qwen3.5-architecture model
    # (qwen3_5_text, three GDN layers to each gated full-attention layer) on the same data
    arch: str = "hcw_hybrid"

    def phase(self, progress: float) -> tuple[int, int]:
        """(seq_len, batch_size) at `progress` in [0, 1] of the run: short sequences first, for the
        retrieval circuit to form quickly, then longer ones at the same tokens per step."""
        k = max(0, self.halvings - int(progress * (self.halvings + 1)))
        return max(32, self.seq_len >> k), self.batch_size << k

    def model_dict(self) -> dict:
        tok = ByteTokenizer()
        if self.arch == "qwen3_5":
            raw = qwen3_5_text_dict(hidden=self.hidden, layers=len(self.layers), vocab=tok.vocab_size, attn_every=4,
                                    max_positions=65536)
            raw["eos_token_id"] = list(tok.eos_ids)
        elif self.arch == "hcw_hybrid":
            raw = hcw_hybrid_dict(hidden=self.hidden, vocab=tok.vocab_size, max_positions=65536,
                                  layer_types=self.layers, window=16, csa_rate=4, hca_rate=64, index_topk=4)
            raw["eos_token_ids"] = list(tok.eos_ids)
        else:
            raise ValueError(f"unknown architecture {self.arch!r}: hcw_hybrid or qwen3_5")
        raw["hcw_tokenizer"] = "byte"
        return raw


def _for_training(model: HybridModel, seed: int) -> HybridModel:
    """init_random draws checkpoint-like ranges; training wants GDN layers that start with a
    memory: per-head step sizes dt log-uniform in [1e-3, 1e-1] (as Mamba and GDN initialise),
    so decays exp(-A*dt) start between 0.2 and 0.999 per token instead of near zero."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, GatedDeltaNet):
                dt = torch.exp(torch.empty(mod.dt_bias.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
                mod.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
    return model


def _losses(logits: torch.Tensor, target: torch.Tensor, answer: torch.Tensor, pad: int):
    """(mean loss over answer tokens, mean loss over every other non-pad token, each row's mean
    answer loss)."""
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                                reduction="none").view_as(target)
    text = (target != pad) & ~answer
    per_row = (per_token * answer).sum(dim=1) / answer.sum(dim=1).clamp(min=1)
    return per_token[answer].mean(), per_token[text].mean(), per_row.detach()


def train(cfg: TrainConfig, out: Path, progress=print, init_from: Path | None = None) -> tuple[dict, HybridModel]:
    """Train and save; returns (summary, the trained model). With `init_from`, start from that
    model folder's weights (same configuration) instead of random ones."""
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    raw = cfg.model_dict()
    model = _for_training(init_random(HybridModel(ModelConfig.from_dict(raw)), cfg.seed), cfg.seed).train()
    if init_from is not None:  # continue from a saved model of the same configuration
        model.load_state_dict(load_model(init_from, device="cpu").state_dict())
        model.requires_grad_(True)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    out.mkdir(parents=True, exist_ok=True)
    pad = ByteTokenizer().specials["<|pad|>"]
    log_path = out / "training_log.jsonl"
    log = log_path.open("w")
    step_offset, seconds_offset = 0, 0.0
    if init_from is not None and (Path(init_from) / "training_log.jsonl").is_file():
        # one curve for the whole run: the earlier run's log first, this one's steps after it
        for line in (Path(init_from) / "training_log.jsonl").read_text().splitlines():
            log.write(line + "\n")
            entry = json.loads(line)
            step_offset, seconds_offset = entry["step"], entry["elapsed_s"]
    t0 = time.perf_counter()
    budget = cfg.minutes * 60
    step = 0
    history = []
    by_kind: dict[str, list[float]] = {}  # answer loss per task kind since the last log line
    while step < cfg.steps and time.perf_counter() - t0 < budget:
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup)
        # cosine decay over the expected number of steps (the time budget, once the rate is known)
        if step > cfg.warmup:
            expected = min(cfg.steps, step / max(time.perf_counter() - t0, 1e-9) * budget)
            lr *= 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(expected, 1))))
        for group in opt.param_groups:
            group["lr"] = lr
        progress_frac = max(step / cfg.steps, (time.perf_counter() - t0) / budget)
        seq_len, batch_size = cfg.phase(progress_frac)
        # every task at every length; a chat that cannot fit a short row comes as a table instead
        ids, mask, kinds = batch(rng, batch_size, seq_len, max_questions=cfg.max_questions, tasks=cfg.tasks)
        logits = model(ids[:, :-1])
        answer_loss, text_loss, per_row = _losses(logits, ids[:, 1:], mask[:, 1:], pad)
        for kind, row_loss in zip(kinds, per_row.tolist()):
            by_kind.setdefault(kind, []).append(row_loss)
        opt.zero_grad(set_to_none=True)
        (answer_loss + cfg.text_weight * text_loss).backward()
        loss = answer_loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        history.append(loss.item())
        if step % cfg.log_every == 0 or step == 1:
            entry = {"step": step_offset + step, "loss": sum(history[-cfg.log_every:]) / len(history[-cfg.log_every:]),
                     "lr": lr, "seq_len": seq_len, "elapsed_s": seconds_offset + time.perf_counter() - t0,
                     "loss_by_kind": {k: round(sum(v) / len(v), 4) for k, v in sorted(by_kind.items())}}
            by_kind.clear()
            log.write(json.dumps(entry) + "\n")
            log.flush()
            kinds_text = " ".join(f"{k} {v:.2f}" for k, v in entry["loss_by_kind"].items())
            progress(f"step {step}  loss {entry['loss']:.4f}  lr {lr:.2e}  len {seq_len}  {entry['elapsed_s']:.0f}s"
                     f"  ({kinds_text})")
    log.close()
    save_model(model, raw, out)
    summary = {"steps": step_offset + step, "params": params, "continued_from": str(init_from) if init_from else None, "final_loss": sum(history[-20:]) / max(1, len(history[-20:])),
               "seconds": seconds_offset + time.perf_counter() - t0, "config": {k: v for k, v in cfg.__dict__.items()}}
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2, default=list) + "\n")
    return summary, model.eval()

"""`hcw generate`: load a folder, tokenize, stream a continuation, report llama.cpp-style timings."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from engine import EngineConfig, load_model
from engine.config import parse_dtype
from engine.engine import Engine, SamplingParams
from engine.tokenizer import StreamDecoder, load_tokenizer


@dataclass(frozen=True)
class GenerateRequest:
    model: Path
    prompt: str | None
    prompt_ids: list[int] | None
    max_new_tokens: int
    greedy: bool
    temperature: float
    top_p: float
    seed: int | None
    dtype: str
    device: str | None
    chunk_size: int
    as_json: bool
    deterministic: bool = False  # bit-exact: prefill one token a step (EngineConfig.deterministic)


def run_generate(req: GenerateRequest, out: TextIO) -> dict:
    model = load_model(req.model, dtype=req.dtype, device=req.device)
    tok = load_tokenizer(req.model, model.config.extra)
    if req.prompt is not None:
        if tok is None:
            raise ValueError(f"{req.model} has no tokenizer; pass token ids with --prompt-ids")
        ids = tok.encode(req.prompt)
    else:
        ids = list(req.prompt_ids or [])
    params = SamplingParams(max_new_tokens=req.max_new_tokens, greedy=req.greedy, temperature=req.temperature,
                            top_p=req.top_p, seed=req.seed, stop_ids=tok.eos_ids if tok else ())
    engine = Engine(model, EngineConfig(dtype=parse_dtype(req.dtype), device=str(model.device),
                                        prefill_chunk_size=req.chunk_size, deterministic=req.deterministic))
    stream = None
    decoder = StreamDecoder(tok) if tok and not req.as_json else None
    if not req.as_json:

        def stream(token: int) -> None:
            out.write(decoder.push(token) if decoder else f"{token} ")
            out.flush()

    result = engine.generate(ids, params, on_token=stream)
    report = {
        "token_ids": result.token_ids,
        "text": tok.decode(result.token_ids) if tok else None,
        "stop_reason": result.stop_reason,
        "deterministic": req.deterministic,
        "timings": result.timings.as_dict(),
    }
    if req.as_json:
        out.write(json.dumps(report) + "\n")
    else:
        out.write((decoder.flush() if decoder else "") + "\n")
    return report

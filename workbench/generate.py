"""`hcw generate`: load a folder, tokenize (with --chat: through the model's chat template, as one
user message), stream a continuation, report llama.cpp-style timings (and with --verbose,
Ollama-style stats on stderr)."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from engine import EngineConfig, load_model
from engine.engine import Engine, SamplingParams
from engine.model.loader import resolve_model
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
    engine: EngineConfig  # its dtype is the one the model loads in; the device is the model's
    device: str | None
    as_json: bool
    chat: bool = False  # the prompt is one user message, through the model's chat template
    system: str | None = None  # with chat: a system message before it
    verbose: bool = False  # Ollama-style stats on `err`


def run_generate(req: GenerateRequest, out: TextIO, err: TextIO | None = None) -> dict:
    if req.chat and req.prompt is None:
        raise ValueError("--chat needs --prompt (text for the chat template), not --prompt-ids")
    if req.system is not None and not req.chat:
        raise ValueError("--system needs --chat: only a chat template places a system message")
    t0 = time.perf_counter()
    model = load_model(req.model, dtype=req.engine.dtype, device=req.device)
    tok = load_tokenizer(resolve_model(req.model), model.config.extra)
    load_ms = 1000 * (time.perf_counter() - t0)
    if req.prompt is not None:
        if tok is None:
            raise ValueError(f"{req.model} has no tokenizer; pass token ids with --prompt-ids")
        if req.chat:
            messages = [{"role": "system", "content": req.system}] if req.system is not None else []
            ids = tok.apply_chat_template([*messages, {"role": "user", "content": req.prompt}],
                                          add_generation_prompt=True)
        else:
            ids = tok.encode(req.prompt)
    else:
        ids = list(req.prompt_ids or [])
    params = SamplingParams(max_new_tokens=req.max_new_tokens, greedy=req.greedy, temperature=req.temperature,
                            top_p=req.top_p, seed=req.seed, stop_ids=tok.eos_ids if tok else ())
    engine = Engine(model, dataclasses.replace(req.engine, device=str(model.device)))
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
        "deterministic": req.engine.deterministic,
        "timings": result.timings.as_dict(),
    }
    if req.as_json:
        out.write(json.dumps(report) + "\n")
    else:
        out.write((decoder.flush() if decoder else "") + "\n")
    if req.verbose and err is not None:
        err.write(stats(report["timings"], load_ms, 1000 * (time.perf_counter() - t0)))
        err.flush()
    return report


def stats(timings: dict, load_ms: float, total_ms: float) -> str:
    """Ollama's --verbose block: durations, counts and rates, from llama.cpp-named timings."""
    def rate(n: int, ms: float) -> str:
        return f"{1000 * n / ms:.2f} tokens/s" if ms else "-"

    rows = [("total duration", _duration(total_ms)), ("load duration", _duration(load_ms)),
            ("prompt eval count", f"{timings['prompt_n']} token(s)"),
            ("prompt eval duration", _duration(timings["prompt_ms"])),
            ("prompt eval rate", rate(timings["prompt_n"], timings["prompt_ms"])),
            ("eval count", f"{timings['predicted_n']} token(s)"),
            ("eval duration", _duration(timings["predicted_ms"])),
            ("eval rate", rate(timings["predicted_n"], timings["predicted_ms"])),
            ("cached tokens", str(timings["cache_n"]))]
    return "".join(f"{name + ':':22}{value}\n" for name, value in rows)


def _duration(ms: float) -> str:
    return f"{ms / 1000:.3f}s" if ms >= 1000 else f"{ms:.2f}ms"

"""`hcw drill`: run every fault drill on a model and report, per drill, the plan, exactness,
max |logit diff| against a full prefill and whether the error was silent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

from engine import EngineConfig, load_model
from engine.cache.faults import DRILLS, run_drills
from workbench.progress import bar


def run(model_dir: Path, names: list[str] | None, block_size: int, prompt_len: int, dtype: str,
        as_json: bool, out: TextIO, show_progress: bool = False, engine: EngineConfig | None = None) -> bool:
    """Print the reports; return True when any drill went wrong silently. With `show_progress`, a
    bar on stderr counts the drills."""
    names = names or list(DRILLS)
    unknown = [n for n in names if n not in DRILLS]
    if unknown:
        raise ValueError(f"unknown drill {unknown[0]!r}; drills: {', '.join(DRILLS)}")
    model = load_model(model_dir, dtype=dtype)
    engine = engine.bind(model) if engine is not None else None
    reports = []
    with bar(len(names), "drills", show_progress) as steps:
        # one drill a call, to count them (each call also runs the cold reference prefill again: the
        # same seed gives the same prompt, so the reports are those of one call with every name)
        for name in names:
            steps.doing(name)
            reports += run_drills(model, prompt_len=prompt_len, block_size=block_size, names=[name], config=engine)
            steps.done()
    silent = any(r.silent for r in reports)
    if as_json:
        out.write(json.dumps({"model": str(model_dir), "model_type": model.config.model_type,
                              "block_size": block_size, "prompt_len": prompt_len,
                              "drills": [r.as_dict() for r in reports], "silent_errors": sum(r.silent for r in reports)})
                  + "\n")
        return silent
    out.write(f"{'drill':22} {'applies':7} {'usable/logical':>14} {'outcome':10} {'max|dlogit|':>11} {'silent':6} path\n")
    for r in reports:
        path = r.paths[0] if r.paths else (r.reasons[0] if r.reasons else "")
        out.write(f"{r.drill:22} {str(r.applies):7} {f'{r.usable_tokens}/{r.logical_tokens}':>14} {r.outcome:10} "
                  f"{r.max_logit_diff:11.2e} {str(r.silent):6} {path}\n")
    out.write(f"silent errors: {sum(r.silent for r in reports)}\n")
    return silent

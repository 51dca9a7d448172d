"""docs/BENCHMARKS.md is assembled from sections, each owned and rewritten by one script."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[1] / "docs" / "BENCHMARKS.md"
HEADER = ("# Benchmarks\n\nEvery table here is written by a script in `benchmarks/`; rerun it to refresh its "
          "section. Speed targets are ratios against a baseline measured in the same process.\n")


def write_section(key: str, title: str, body: str) -> None:
    text = DOC.read_text() if DOC.exists() else HEADER
    stamp = dt.date.today().isoformat()
    block = f"<!-- section:{key} -->\n## {title}\n\n_Measured {stamp}._\n\n{body}\n<!-- /section:{key} -->\n"
    pattern = re.compile(rf"<!-- section:{key} -->.*?<!-- /section:{key} -->\n", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)


def parse_args(parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Every benchmark's flags (--quick, --no-write), its thread setting (the 2 cores CI has) and,
    as the CLI does, the HCW_* variables mapped onto an EngineConfig (`args.engine`) with the
    kernel choice made for the process."""
    from engine.engine_config import EngineConfig
    from kernels import dispatch

    parser = parser or argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="short run")
    parser.add_argument("--no-write", action="store_true", help="print, do not touch docs/BENCHMARKS.md")
    args = parser.parse_args()
    torch.set_num_threads(2)
    try:
        args.engine = EngineConfig.from_env(os.environ)
    except ValueError as e:  # ConfigError: a bad HCW_* value, one line and exit 2
        parser.error(str(e))
    dispatch.select(args.engine.kernels, args.engine.native)
    return args

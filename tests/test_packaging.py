"""The wheel and the sdist carry what a fresh install needs besides code: the built-in models'
weights and configs (so `load_model("hcw-tiny")` and `hcw chat` work with no download, and so does
`hcw bench replay --model hcw-tiny-qwen3.5`), the TUI stylesheet and the C decode kernels' source
(built on first use)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDED = ("engine/models/hcw-tiny/config.json", "engine/models/hcw-tiny/model.safetensors",
          "engine/models/hcw-tiny-qwen3.5/config.json", "engine/models/hcw-tiny-qwen3.5/model.safetensors",
          "workbench/tui/app.tcss", "kernels/native/gdn_decode.c", "kernels/native/attn_decode.c",
          "kernels/native/rms_norm.c")


def test_wheel_and_sdist_ship_the_default_model_and_the_stylesheet(tmp_path):
    # setuptools reads sys.argv: the output folder goes through the environment
    build = ("import os; from setuptools import build_meta as b; d = os.environ['HCW_BUILD_OUT']; "
             "w = b.build_wheel(d); s = b.build_sdist(d); print('BUILT', w, s)")
    out = subprocess.run([sys.executable, "-c", build], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "HCW_BUILD_OUT": str(tmp_path)}).stdout
    _, wheel_name, sdist_name = next(line for line in out.splitlines() if line.startswith("BUILT ")).split()
    wheel, sdist = tmp_path / wheel_name, tmp_path / sdist_name
    names = set(zipfile.ZipFile(wheel).namelist())
    assert all(n in names for n in NEEDED), sorted(n for n in names if "models" in n or "tcss" in n)
    size = zipfile.ZipFile(wheel).getinfo("engine/models/hcw-tiny/model.safetensors").file_size
    assert size <= 30 << 20  # the limit for shipped weights
    members = tarfile.open(sdist).getnames()
    assert all(any(m.endswith(n) for m in members) for n in NEEDED)

#!/usr/bin/env bash
# Downloads into .whl/ the wheels benchmarks/gpu_check.sh installs on a GPU machine that cannot
# reach a package index: what hcw and its tests need beyond the machine's own image (which has
# torch, triton, transformers, typer, numpy, xxhash, psutil, safetensors, tokenizers, hypothesis,
# pytest), for its Python (3.12, x86-64 Linux). Run it here, where pip can download.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --no-deps --only-binary=:all: --python-version "${PY:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl textual==8.2.8 mdit-py-plugins platformdirs sqlite-utils==4.2.1 click-default-group sqlite-fts4 \
    linkify-it-py uc-micro-py zstandard==0.25.0 pytest-textual-snapshot==1.1.0 syrupy==4.8.0
ls .whl

#!/usr/bin/env bash
# One prepared run for a GPU machine: install, the CUDA tests (every kernel against its reference
# compiled for the GPU, the engine's paged KV and the CUDA-graph decode), then the kernel and engine
# benchmarks, which write their section of docs/BENCHMARKS.md. Prints a report and copies it to
# OUT_DIR (default $OUT, else gpu-report/).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]          FULL=1 also runs the whole suite there
#
# A GPU machine may have no network: there its own python3 (with torch and triton) is used as it
# is, what it lacks is installed from wheels in .whl/ into a folder of its own, and hcw runs from
# this checkout (PYTHONPATH); benchmarks/gpu_wheels.sh downloads the wheels where pip can reach an
# index (carry .whl to the machine). Without .whl/, a venv gets the test extra from the index.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-report}}"
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/hcw-site .whl/*.whl 2>&1 | tail -3
    export PYTHONPATH="$PWD:/tmp/hcw-site${PYTHONPATH:+:$PYTHONPATH}"
else
    python3 -m venv .venv-gpu && . .venv-gpu/bin/activate && pip install -q -e '.[test]' 2>&1 | tail -3
fi
python3 - <<'PY' | tee "$out/device.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
PY
python3 -m pytest -q tests/test_kernels.py tests/test_paged_kv.py tests/test_static_decode.py 2>&1 \
    | tee "$out/cuda_tests.txt" | tail -5
if [ "${FULL:-0}" = 1 ]; then
    python3 -m pytest -q -x tests 2>&1 | tee "$out/suite.txt" | tail -3
fi
python3 benchmarks/kernels.py 2>&1 | tee "$out/kernels.txt"
cp docs/BENCHMARKS.md "$out/"
echo "report in $out/"

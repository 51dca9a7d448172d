#!/usr/bin/env bash
# One prepared run for a GPU machine: install, the kernel tests compiled on CUDA, the whole suite,
# then the kernel and engine benchmarks (their section of docs/BENCHMARKS.md). Prints a report;
# the figures go into docs/BENCHMARKS.md by the benchmark itself.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-report}}"
mkdir -p "$out"
python -m venv .venv-gpu && . .venv-gpu/bin/activate
pip install -q -e '.[test]' 2>&1 | tail -3
python - <<'PY' | tee "$out/device.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
PY
python -m pytest -q tests/test_kernels.py 2>&1 | tee "$out/kernel_tests.txt" | tail -3
python -m pytest -q -x tests 2>&1 | tee "$out/suite.txt" | tail -3
python benchmarks/kernels.py 2>&1 | tee "$out/kernels.txt"
cp docs/BENCHMARKS.md "$out/"
echo "report in $out/"

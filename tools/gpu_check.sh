#!/usr/bin/env bash
# The whole GPU check in one device call: GPU tests, then the benchmarks (tables and JSON
# into $OUT). Usage on the device machine: bash tools/gpu_check.sh [tests|bench|all] [cast args...]
set -uo pipefail
what=${1:-all}
shift || true
OUT=${OUT:-/tmp/fp8train-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if [[ $what == tests || $what == all ]]; then
  timeout 420 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rfE --tb=short 2>&1 > "$OUT/test-gpu.log"
  grep -E "^FAILED|^ERROR" "$OUT/test-gpu.log" | sed 's/\[.*//' | sort | uniq -c | head -30
  tail -1 "$OUT/test-gpu.log"
fi
if [[ $what == bench || $what == all ]]; then
  timeout 120 python3 benchmarks/linear.py --json "$OUT/linear.json" 2>&1 | tee "$OUT/linear.log" | tail -16
  timeout 200 python3 benchmarks/mlp.py --json "$OUT/mlp.json" 2>&1 | tee "$OUT/mlp.log" | tail -40
  timeout 150 python3 benchmarks/cast.py --json "$OUT/cast.json" "$@" 2>&1 | tee "$OUT/cast.log" | tail -20
fi

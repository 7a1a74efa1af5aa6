#!/usr/bin/env bash
# The whole GPU suite in four concurrent pytest shards (the suite is mostly Triton compiles
# and Python: CPU-bound on the 16-core GPU host), then one combined summary line.
# Usage on the GPU machine: bash tools/gpu_tests_parallel.sh OUTDIR
set -uo pipefail
out=${1:-/tmp/fp8train-gpu-tests}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
run() {  # name, pytest args...
  local name=$1; shift
  timeout 540 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short "$@" > "$out/$name.log" 2>&1
}
run kernels tests/gpu/test_kernels_gpu.py &
run activation tests/gpu/test_activation_gpu.py &
run norm tests/gpu/test_norm_gpu.py tests/gpu/test_transpose_gpu.py tests/gpu/test_launcher_gpu.py &
run rest tests --ignore=tests/gpu/test_kernels_gpu.py --ignore=tests/gpu/test_activation_gpu.py \
  --ignore=tests/gpu/test_norm_gpu.py --ignore=tests/gpu/test_transpose_gpu.py --ignore=tests/gpu/test_launcher_gpu.py &
wait
grep -hE "^(FAILED|ERROR)" "$out"/*.log | sed 's/ - .*//' | head -40
python3 - "$out" <<'PY'
import pathlib, re, sys
totals, secs = {}, 0.0
for log in sorted(pathlib.Path(sys.argv[1]).glob("*.log")):
    last = [l for l in log.read_text().splitlines() if l.strip()][-1:] or [""]
    print(f"{log.stem}: {last[0]}")
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|warnings?)", last[0]):
        what = {"error": "errors", "warning": "warnings"}.get(what, what)
        totals[what] = totals.get(what, 0) + int(n)
    m = re.search(r"in ([\d.]+)s", last[0])
    secs = max(secs, float(m.group(1))) if m else secs
order = ["passed", "failed", "skipped", "errors", "warnings"]  # deselected: per shard, not additive
print("combined: " + ", ".join(f"{totals[k]} {k}" for k in order if k in totals) + f" in {secs:.2f}s (4 shards)")
PY

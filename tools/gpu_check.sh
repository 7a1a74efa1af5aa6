#!/usr/bin/env bash
# The whole GPU check in one device call, as named steps (tables and JSON into $OUT):
#   info   versions, GPUs, NCCL version, the GPU topology (nvidia-smi topo -m)
#   tp     benchmarks/tp.py under torchrun on every visible GPU (N=1 on one GPU)
#   mlp    benchmarks/mlp.py (torchao joins when its wheel lies in .whl/: installed to /tmp/site)
#   bench  benchmarks/linear.py, mlp.py, cast.py
#   kernels  benchmarks/activation.py and norm.py, each with its launch-shape sweep (--variants)
#   small  benchmarks/small.py (small MLP sizes: graphs, auto precision, torchao reduce-overhead)
#   demo   the 2000-step GPU demo, hybrid and (second GPU) e4m3 formats side by side
#   tests  the GPU suite (tools/gpu_tests_parallel.sh: shards over the GPUs, then multi-GPU files)
#   native the C++ Linear node: its build, its GPU tests beside the Linear and graph tests, the
#          host-time ratio (benchmarks/linear.py, 1024 only)
#   lt     the extension's cuBLASLt GEMM: its GPU tests, the node/fused/graph tests, the node's
#          stage clocks, the Linear host-time ratio and LayerNormMLP's host time, each with A/B
#   high   the high-precision C++ node (csrc/high_mlp.cpp): its GPU tests beside the native,
#          precision, compile, fused-module, graph, MLP-node and replay tests (two shards where
#          there are two GPUs)
#   hf     the HF Llama GPU tests (tests/gpu/test_hf_llama_gpu.py), then benchmarks/hf_llama.py
#          at h1024 (one compile per compiled variant)
#   hf-h1024, hf-h2048, hf-h4096, hf-block4096  benchmarks/hf_llama.py at that shape (no tests; block4096:
#          T5's one block, 4 x 2048 tokens; HF_TIMEOUT s, default 560). hf steps: VARIANTS picks the
#          variants (default: the ten of $HF_CORE below; all of them took over 10 minutes at
#          h1024 with the tests before them), HOST_TOP=N adds each variant's largest host self times,
#          DEVICE_TOP=N its device time by kernel kind and its N largest kernels, PYTHON_TOP=N its
#          N Python functions with the largest self time (cProfile), IDLE_TOP=N its GPU idle time
#          and the N host ops launching after the largest shares of it, ROUNDS=N the timing rounds (default 5:
#          a host-bound step's rounds range over 30%, rounds cost ~1 s, compiles minutes); compiles take 50-130 s a
#          variant (h2048: three variants did not finish in 250 s)
#   hf-code  Inductor's generated code (TORCH_LOGS=output_code) of one h1024 step of each
#          VARIANTS (default: fp8 compile current) into $OUT/hf_code.log: which kernels a
#          compiled step launches and what its Python wrapper does between them
#   hf-static  Inductor's static launcher for fp8train's Triton kernels (the casts are user-defined
#          kernels, which Inductor launches through Triton's own launcher unless
#          static_launch_user_defined_triton_kernels is set: torch's env TORCHINDUCTOR_STATIC_LAUNCH_
#          USER_DEFINED_TRITON_KERNELS, read at import), A/B in alternating processes: PAIRS (default 2)
#          pairs of benchmarks/hf_llama.py at h1024, without then with it, each timing VARIANTS (default
#          fp8 compile current, torchao compile; ROUNDS default 5), printing each run's ratio to torchao
#          (a host that drifts between processes cancels in it); ~2.5 minutes a run where it compiles
#   gemm   benchmarks/gemm.py: a Llama layer's GEMMs per tensor and block-scaled (cuBLASLt) at
#          GEMM_SHAPES (default h1024,h2048)
#   numerics-h1024, numerics-h2048  benchmarks/numerics.py at that shape: seeds SEEDS (default
#          "0"; several run side by side on the one GPU, losses are not timed), recipes RECIPES
#          (default: the script's; torchao's need its wheel carried), SCHEDULE (const, the default, or
#          cosine: warm-up then cosine), INSPECT_EVERY (fp8train.inspect's period in steps, default
#          250); into $OUT: the seeds' merge (numerics_<shape>.json: gaps paired only within a
#          seed's own run, each holds its own bf16) and their JSON and logs in one archive (~1 minute
#          per recipe at h1024; at h2048 three seeds of four recipes side by side ~6.5 minutes; seeds run
#          side by side as far as GPU memory allows: 9 at h1024 and 5 at h2048 on an 80 GB H100, the rest
#          start as others end)
#   block  BlockScaling on the GPU: its GPU tests (both GEMM paths, the compiled Linear, the C++
#          node's block path, stacked siblings; the casts' own: blockcast), then
#          benchmarks/hf_llama.py's block variants at h1024 beside BF16, eager and compiled (the
#          default; "hiwgrad": BlockScaling(fp8_wgrad=False), the wgrad in bf16 and one-way casts;
#          "packed": the transposed copies packed in words)
#   blockcast  the block cast kernels' GPU tests (and the gated forms' and GatedMLP's, modules/stacked.py
#          GATED; three processes), then benchmarks/cast.py --block-only: their bandwidth against a
#          copy (CAST_COMPILE=1: and against torch.compile of their torch-op form), with their
#          launch-shape variants, on an HF Llama h2048 q/k/v input (8192 x 2048 float32) and a
#          bf16 gradient (8192 x 5632; the gated forms at that width too, the norm's on the float32 input)
#   blocksweep-h1024, blocksweep-h2048  that sweep alone at that shape's sizes (h1024: float32 8192 x 1024,
#          bf16 8192 x 2816); CAST_FIELDS picks the BlockShapes fields (e.g. both,gated,norm)
#   fsdp   benchmarks/fsdp.py under torchrun on every visible GPU (N=1 on one GPU: the code path;
#          HOST_TOP=N adds each variant's largest host self times), then the FSDP cases with NCCL
#          (tests/gpu/test_fsdp_gpu.py; the gloo cases need torch 2.13's FSDP2 on CPU)
#   replay the launch groups (kernels/replay.py) and the C++ LayerNormMLP node: their GPU tests
#          beside the fused-module and graph tests, then LayerNormMLP's host time each way
# Usage on the device machine: bash tools/gpu_check.sh [info] [tp] [mlp] [bench] [kernels] [small] [demo] [tests] [native] [high] [replay] [lt] [hf] [hf-h1024] [hf-h2048] [hf-h4096] [hf-block4096] [gemm] [hf-code] [hf-static] [numerics-h1024] [numerics-h2048] [block] [blockcast] [blocksweep-h1024] [blocksweep-h2048] [fsdp]
#   (default: info tests bench)
set -uo pipefail
steps=${*:-info tests bench}
OUT=${OUT:-/tmp/fp8train-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
HF_CORE="bf16 eager,bf16 compile,fp8 eager current,fp8 eager delayed,fp8 compile current,fp8 compile delayed,\
fp8 compile-ro delayed,fp8 compile-ro current,torchao compile,torchao compile-ro"  # current: the default recipe
if compgen -G ".whl/torchao-*.whl" > /dev/null && [[ ! -d /tmp/site/torchao ]]; then
  python3 -m pip install -q --no-deps --target /tmp/site .whl/torchao-*.whl 2>&1 | tail -2
fi
[[ -d /tmp/site/torchao ]] && export PYTHONPATH=$PYTHONPATH:/tmp/site
block_sweep() {  # shape: benchmarks/cast.py --block-only with its variants at that HF Llama shape's sizes
  # (a q/k/v input, float32: the plain and the norm's forms; a bf16 MLP-wide gradient: the plain
  # and the gated forms); CAST_FIELDS: the BlockShapes fields swept (default all); CAST_COMPILE=1:
  # against torch.compile of their torch-op form too
  local h f=${CAST_FIELDS:+--fields $CAST_FIELDS} nc
  h=$([[ $1 == h1024 ]] && echo "1024 2816" || echo "2048 5632")
  nc=$([[ "${CAST_COMPILE:-0}" == 1 ]] || echo --no-compile)
  timeout 200 python3 benchmarks/cast.py --block-only $nc --variants $f --rows 8192 --cols "${h% *}" \
    --input-dtype float32 --json "$OUT/cast_block_f32_$1.json" 2>&1 | tee "$OUT/cast_block_f32_$1.log"
  timeout 200 python3 benchmarks/cast.py --block-only $nc --variants $f --rows 8192 --cols "${h#* }" \
    --json "$OUT/cast_block_bf16_$1.json" 2>&1 | tee "$OUT/cast_block_bf16_$1.log"
}
for step in $steps; do
  echo "=== $step ($(date +%T))"
  case $step in
    info)
      python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.get_device_name(), 'x', torch.cuda.device_count(), 'NCCL', torch.cuda.nccl.version())"
      nvidia-smi topo -m 2>&1 | tee "$OUT/topo.txt" | head -12 ;;
    tp)
      timeout 300 torchrun --standalone --nproc-per-node "$ngpu" benchmarks/tp.py --graphed --json "$OUT/tp.json" 2>&1 \
        | tee "$OUT/tp.log" | grep -v "^W1\|OMP_NUM\|\*\*\*\*" | tail -40 ;;
    mlp)
      timeout 240 python3 benchmarks/mlp.py --json "$OUT/mlp.json" 2>&1 | tee "$OUT/mlp.log" | tail -40 ;;
    bench)
      timeout 120 python3 benchmarks/linear.py --json "$OUT/linear.json" 2>&1 | tee "$OUT/linear.log" | tail -16
      timeout 200 python3 benchmarks/mlp.py --json "$OUT/mlp.json" 2>&1 | tee "$OUT/mlp.log" | tail -40
      timeout 150 python3 benchmarks/cast.py --json "$OUT/cast.json" 2>&1 | tee "$OUT/cast.log" | tail -20 ;;
    kernels)
      timeout 200 python3 benchmarks/activation.py --variants --json "$OUT/activation.json" 2>&1 \
        | tee "$OUT/activation.log" | tail -30
      timeout 200 python3 benchmarks/norm.py --variants --json "$OUT/norm.json" 2>&1 | tee "$OUT/norm.log" | tail -30 ;;
    small)
      timeout 540 python3 benchmarks/small.py --json "$OUT/small.json" 2>&1 | tee "$OUT/small.log" | tail -45 ;;
    demo)
      # the 2000-step GPU demo, graphed, in both FP8 formats: side by side on two GPUs when
      # there are two (about 6-7 minutes each), else the hybrid one only
      CUDA_VISIBLE_DEVICES=0 timeout 560 python3 -m fp8train demo --device cuda --out "$OUT/demo_hybrid" \
        > "$OUT/demo_hybrid.log" 2>&1 &
      if [[ $ngpu -ge 2 ]]; then
        CUDA_VISIBLE_DEVICES=1 timeout 560 python3 -m fp8train demo --device cuda --fp8-format e4m3 \
          --out "$OUT/demo_e4m3" > "$OUT/demo_e4m3.log" 2>&1 &
      fi
      wait
      for log in "$OUT"/demo_*.log; do echo "--- $log"; grep -v "it/s\|s/it" "$log" | tail -14; done ;;
    tests)
      bash tools/gpu_tests_parallel.sh "$OUT/tests" ;;
    native)
      python3 -c "from fp8train.kernels import native; print('C++ node:', 'built' if native.extension() else native.failure())"
      timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/gpu/test_native_gpu.py \
        tests/gpu/test_linear_gpu.py tests/gpu/test_graphs_gpu.py 2>&1 | tail -12
      timeout 80 python3 benchmarks/linear.py --sizes 1024 --json "$OUT/linear_host.json" 2>&1 | tail -6 ;;
    hf)
      timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/gpu/test_hf_llama_gpu.py \
        2>&1 | grep -E "passed|failed|^(FAILED|ERROR)"
      timeout 420 python3 benchmarks/hf_llama.py --shapes h1024 --host-top "${HOST_TOP:-0}" --device-top "${DEVICE_TOP:-0}" \
        --variants "${VARIANTS:-$HF_CORE}" --json "$OUT/hf_h1024.json" 2>&1 \
        | tee "$OUT/hf_h1024.log" | grep -E "^(h1024|variant|bf16|fp8|torchao|  host|  dev|  round|  path|  tune)|failed" ;;
    hf-h1024|hf-h2048|hf-h4096|hf-block4096)
      shape=${step#hf-}
      timeout "${HF_TIMEOUT:-560}" python3 benchmarks/hf_llama.py --shapes "$shape" --host-top "${HOST_TOP:-0}" --device-top "${DEVICE_TOP:-0}" \
        --rounds "${ROUNDS:-5}" --python-top "${PYTHON_TOP:-0}" --idle-top "${IDLE_TOP:-0}" --variants "${VARIANTS:-$HF_CORE}" --json "$OUT/hf_$shape.json" 2>&1 \
        | tee "$OUT/hf_$shape.log" | grep -E "^($shape|variant|bf16|fp8|torchao|  host|  dev|  py|  idle|  round|  path|  tune)|failed" ;;
    gemm)
      timeout 300 python3 benchmarks/gemm.py --shapes "${GEMM_SHAPES:-h1024,h2048}" --json "$OUT/gemm.json" 2>&1 \
        | tee "$OUT/gemm.log" ;;
    hf-code)
      TORCH_LOGS=output_code timeout 300 python3 benchmarks/hf_llama.py --shapes h1024 --rounds 1 --steps 2 \
        --profile-steps 0 --variants "${VARIANTS:-fp8 compile current}" --json "$OUT/hf_code.json" > "$OUT/hf_code.log" 2>&1
      grep -c "def call(" "$OUT/hf_code.log"; grep -oE "^  (round|h1024).*" "$OUT/hf_code.log" | tail -3 ;;
    hf-static)
      for pair in $(seq "${PAIRS:-2}"); do
        for static in 0 1; do
          TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=$static timeout 290 python3 benchmarks/hf_llama.py \
            --shapes h1024 --rounds "${ROUNDS:-5}" --variants "${VARIANTS:-fp8 compile current,torchao compile}" \
            --json "$OUT/hf_static${static}_$pair.json" > "$OUT/hf_static${static}_$pair.log" 2>&1
          python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['shapes']['h1024']['rows']:
    print(f\"  pair $pair static $static {r['variant']:24s} wall {r['wall_ms']:6.2f} device {r['device_ms']:6.2f} \"
          f\"vs torchao {r['vs_torchao'] or float('nan'):.3f} loss {r['loss']:.3f}\")" "$OUT/hf_static${static}_$pair.json" \
            || tail -5 "$OUT/hf_static${static}_$pair.log"
        done
      done ;;
    numerics-h1024|numerics-h2048)
      shape=${step#numerics-}
      # as many seeds at once as GPU memory holds: an h2048 seed's process peaks at ~14.2 GiB
      # (six of them ran out of memory on an 80 GB H100, 2026-12-06), an h1024 one at well under 8
      per_seed=$([[ $shape == h2048 ]] && echo 15 || echo 8)
      gib=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory // 2**30)")
      at_once=$(( gib / per_seed > 0 ? gib / per_seed : 1 )); running=0
      for seed in ${SEEDS:-0}; do
        if (( running >= at_once )); then wait -n; running=$((running - 1)); fi
        timeout 570 python3 benchmarks/numerics.py --shapes "$shape" --seeds 1 --first-seed "$seed" \
          ${RECIPES:+--recipes "$RECIPES"} ${SCHEDULE:+--schedule "$SCHEDULE"} \
          ${INSPECT_EVERY:+--inspect-every "$INSPECT_EVERY"} --json "$OUT/numerics_${shape}_s$seed.json" \
          > "$OUT/numerics_${shape}_s$seed.log" 2>&1 &
        running=$((running + 1))
      done
      wait
      for seed in ${SEEDS:-0}; do grep -v "Warn\|warn\|append" "$OUT/numerics_${shape}_s$seed.log" | tail -8; done
      for seed in ${SEEDS:-0}; do  # the merge below counts only the seeds that wrote their JSON
        [[ -s "$OUT/numerics_${shape}_s$seed.json" ]] || echo "seed $seed: NO RESULT (its log is in the archive)"
      done
      # the device returns only a few files: the seeds' JSON and logs travel as one archive, with
      # their merge (pairs within each seed's file) beside it
      python3 benchmarks/numerics.py --merge "$OUT"/numerics_${shape}_s*.json --json "$OUT/numerics_${shape}.json" \
        2>&1 | grep -v "Warn\|warn" | tail -8
      tar -czf "$OUT/numerics_${shape}_seeds.tar.gz" -C "$OUT" $(cd "$OUT" && ls numerics_${shape}_s*.json \
        numerics_${shape}_s*.log) && rm -f "$OUT"/numerics_${shape}_s*.json "$OUT"/numerics_${shape}_s*.log ;;
    block)
      # the casts' own tests (480 cases): blockcast
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/gpu/test_block_scaling_gpu.py \
        tests/gpu/test_block_native_gpu.py tests/gpu/test_stacked_siblings_gpu.py 2>&1 \
        | tee "$OUT/block_tests.log" \
        | grep -E "passed|failed|^(FAILED|ERROR)"
      timeout 420 python3 benchmarks/hf_llama.py --shapes h1024 --rounds 3 --device-top "${DEVICE_TOP:-6}" \
        --variants "${VARIANTS:-bf16 eager,bf16 compile,fp8 eager block,fp8 compile block,fp8 compile block hiwgrad,fp8 compile block packed}" \
        --json "$OUT/hf_block.json" 2>&1 \
        | tee "$OUT/hf_block.log" \
        | grep -E "^(h1024|variant|bf16|fp8|torchao|  host|  dev|  round|  path|  tune)|failed" ;;
    blockcast)
      # 590 cases, most a Triton compile (440 took 385 s in one process beside the suite's other
      # shards, 2026-12-07): three processes
      t="timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short"
      $t tests/gpu/test_gated_stacked_gpu.py 2>&1 | grep -E "passed|failed|^(FAILED|ERROR)" &
      $t tests/gpu/test_block_cast_gpu.py -k both 2>&1 | grep -E "passed|failed|^(FAILED|ERROR)" &
      $t tests/gpu/test_block_cast_gpu.py -k "not both" 2>&1 | grep -E "passed|failed|^(FAILED|ERROR)" &
      wait
      block_sweep h2048 ;;
    blocksweep-h1024|blocksweep-h2048)
      block_sweep "${step#blocksweep-}" ;;
    fsdp)
      timeout 400 torchrun --standalone --nproc-per-node "$ngpu" benchmarks/fsdp.py --json "$OUT/fsdp.json" \
        --host-top "${HOST_TOP:-0}" 2>&1 \
        | tee "$OUT/fsdp.log" | grep -v "^W1\|OMP_NUM\|\*\*\*\*\|Warn\|warn" | tail -14
      timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/gpu/test_fsdp_gpu.py 2>&1 \
        | tail -8 ;;
    replay)
      python3 -c "from fp8train.kernels import native; print('C++ extension:', 'built' if native.extension() else native.failure())"
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/gpu/test_replay_gpu.py \
        tests/gpu/test_mlp_node_gpu.py tests/gpu/test_fused_modules_gpu.py tests/gpu/test_graphs_gpu.py 2>&1 | tail -12
      timeout 150 python3 tools/host_profile_mlp.py 2>&1 | tee "$OUT/host_profile_mlp.log" | grep "^== " ;;
    high)
      python3 -c "from fp8train.kernels import native; print('C++ extension:', 'built' if native.extension() else native.failure())"
      CUDA_VISIBLE_DEVICES=0 timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
        tests/gpu/test_high_node_gpu.py tests/gpu/test_precision_gpu.py tests/gpu/test_compile_gpu.py \
        tests/gpu/test_native_gpu.py > "$OUT/high_a.log" 2>&1 &
      CUDA_VISIBLE_DEVICES=$((ngpu - 1)) timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
        tests/gpu/test_fused_modules_gpu.py tests/gpu/test_graphs_gpu.py tests/gpu/test_mlp_node_gpu.py \
        tests/gpu/test_replay_gpu.py > "$OUT/high_b.log" 2>&1 &
      wait
      for log in "$OUT"/high_a.log "$OUT"/high_b.log; do grep -h "^FAILED\|^ERROR" "$log" | head -8; tail -1 "$log"; done ;;
    lt)
      python3 -c "from fp8train.kernels import native; e = native.extension(); print('C++ extension:', \
'built, libcublasLt %s' % e.lt_version() if e else native.failure())"
      timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=line tests/gpu/test_lt_gemm_gpu.py 2>&1 \
        | tail -15
      timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=line tests/gpu/test_native_gpu.py \
        tests/gpu/test_mlp_node_gpu.py tests/gpu/test_replay_gpu.py tests/gpu/test_linear_gpu.py \
        tests/gpu/test_graphs_gpu.py tests/gpu/test_fused_modules_gpu.py 2>&1 | tail -12
      PYTHONPATH=$PYTHONPATH:benchmarks timeout 150 python3 tools/probe_node_stages.py 2>&1 | grep -v "warn\|Warn" | tail -20
      timeout 100 python3 benchmarks/linear.py --sizes 1024 --json "$OUT/linear_host.json" 2>&1 | tail -8
      timeout 120 python3 tools/host_profile_mlp.py 2>&1 | tee "$OUT/host_profile_mlp.log" | grep "^== " ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done

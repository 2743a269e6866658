#!/bin/bash
# One GPU check, about 10 minutes on one H100/H200: run it whenever a session has a GPU.
#
#   bash benchmarks/gpu_check.sh [RESULTS_DIR]
#
# Writes everything to RESULTS_DIR (default benchmarks/results/gpu_<gpu>_<date>/):
#   env.txt                  nvidia-smi, torch / CUDA versions
#   ops_build.log            the CUDA ops built once up front (ENGINE_BUILD_OPS=1), not in a step
#   gpu_tests.log            the GPU test tier (tests/gpu, marked gpu)
#   adam_cuda.json/.log      fused AdamW kernel vs torch, bandwidth vs the device copy bandwidth (HBM)
#   fp8_cast_cuda.json/.log  FP8 cast kernel vs reference, bandwidth vs HBM
#   throughput_1b_bf16.json  1-GPU bf16 run of the ~1B config (tokens/s, MFU, time split, peak memory)
#   throughput_1b_fp8.json   the same with fp8.enabled
#   zero_memory_1gpu.md      peak torch.cuda.max_memory_allocated per ZeRO stage 0-3 (1 GPU: dp = 1,
#                            so the stages differ only in bookkeeping; the dp > 1 table needs more GPUs)
#   summary.md               the figures above in one place
# Each step has its own time limit; a failing step is recorded and the script goes on.
set -uo pipefail
cd "$(dirname "$0")/.."
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '-' | tr -cd 'A-Za-z0-9-')
OUT=${1:-benchmarks/results/gpu_${GPU:-unknown}_$(date -u +%Y-%m-%d)}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export ENGINE_EXTENSIONS_DIR=${ENGINE_EXTENSIONS_DIR:-$PWD/build/extensions}
CONFIG=benchmarks/configs/gpt1b_seq2048_bf16.json
STATUS=()

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log, record the exit status
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    STATUS+=("| $name | $rc | $((SECONDS - t0)) s |")
    tail -3 "$OUT/$name.log"
}

{
    nvidia-smi
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"
} > "$OUT/env.txt" 2>&1

# build both CUDA extensions before anything times them (a JIT build inside the first step
# would hold every peer in a collective)
step ops_build 240 env ENGINE_BUILD_OPS=1 python -m engine.ops --load
step gpu_tests 150 python -m pytest -q -m gpu tests/gpu
step adam_cuda 60 python benchmarks/kernels/adam.py --device cuda --no-deepspeed --out "$OUT/adam_cuda.json"
step fp8_cast_cuda 60 python benchmarks/kernels/fp8_cast.py --device cuda --out "$OUT/fp8_cast_cuda.json"
SMALL=(--set train_micro_batch_size_per_gpu=4 --set gradient_accumulation_steps=4 --nproc 1)
step throughput_1b_bf16 120 python benchmarks/throughput.py --config "$CONFIG" "${SMALL[@]}" --steps 6 --warmup 2 \
    --split-steps 1 --json "$OUT/throughput_1b_bf16.json"
step throughput_1b_fp8 120 python benchmarks/throughput.py --config "$CONFIG" "${SMALL[@]}" --set fp8.enabled=true \
    --steps 6 --warmup 2 --split-steps 1 --json "$OUT/throughput_1b_fp8.json"
for s in 0 1 2 3; do
    step "zero${s}_memory" 60 python benchmarks/throughput.py --config "$CONFIG" "${SMALL[@]}" \
        --set zero_optimization.stage=$s --steps 1 --warmup 1 --split-steps 0 --json "$OUT/zero${s}_memory.json"
done

python - "$OUT" <<'EOF' > "$OUT/zero_memory_1gpu.md"
import json, os, sys
out = sys.argv[1]
print("| ZeRO stage | peak allocated GiB (torch.cuda.max_memory_allocated) | params GiB | grads GiB | optimizer GiB |")
print("|---|---|---|---|---|")
for s in range(4):
    path = os.path.join(out, f"zero{s}_memory.json")
    if not os.path.exists(path):
        print(f"| {s} | (failed: see zero{s}_memory.log) | | | |")
        continue
    m = json.load(open(path))["memory_per_rank"][0]
    gib = lambda b: f"{b / 2**30:.2f}"
    print(f"| {s} | {gib(m['peak_bytes'])} | {gib(m['params_bytes'])} | {gib(m['grads_bytes'])} | "
          f"{gib(m['optimizer_state_bytes'])} |")
EOF

{
    echo "# GPU check $(date -u +%Y-%m-%dT%H:%MZ) on ${GPU:-unknown}"
    echo
    echo "| step | exit | time |"
    echo "|---|---|---|"
    printf '%s\n' "${STATUS[@]}"
    echo
    for f in throughput_1b_bf16 throughput_1b_fp8; do
        [ -f "$OUT/$f.json" ] && python -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], {k: r.get(k) for k in ('tokens_per_s', 'mfu', 'step_ms', 'peak_source')})" "$OUT/$f.json" "$f"
    done
    echo
    cat "$OUT/zero_memory_1gpu.md"
} > "$OUT/summary.md"
cat "$OUT/summary.md"

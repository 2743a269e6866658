#!/bin/bash
# The first GPU check, fitted to a lent single-GPU machine (H100/H200, torch 2.11, python3):
#
#   bash benchmarks/gpu_check.sh OUT            # run it (at most ~7 minutes)
#   bash benchmarks/gpu_check.sh OUT --dry-run  # print each step's command, time box and the files
#
# Everything runs in a temporary directory (extensions, logs, JSON; no file is written into
# the tree) and at the end exactly three files are left in OUT:
#   OUT/summary.md      one table: each step's exit status and time, then the figures
#                       (host syncs per step, peak memory, tokens/s, MFU, kernel speeds)
#   OUT/results.json    every step's JSON, keyed by step
#   OUT/logs.tar.gz     every step's log
# Steps (each time-boxed; the whole check has a 7-minute deadline, a step never runs past it):
#   versions     torch / CUDA / device (benchmarks/gpu_smoke.py versions)
#   ops_build    the CUDA kernels, built in the background from the start
#   smoke        engine at world size 1: ZeRO 0-3, tied embeddings, activation checkpointing
#                with document masking, Muon; host syncs inside each step counted
#   gpu_tests    tests/gpu (the kernels against their references), after the build
#   fused        FusedAdamW and FP8 end to end; fails when a kernel did not build or load
#   adam_kernel  the fused AdamW kernel's bandwidth next to torch's
#   throughput   tokens/s and MFU of the ~1B config, when at least 100 s are left
# Exit status: 0 only when every step passed; a kernel that did not build fails the check.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:?usage: bash benchmarks/gpu_check.sh OUT [--dry-run]}
DRY=0
[ "${2:-}" = "--dry-run" ] && DRY=1
DEADLINE=${GPU_CHECK_DEADLINE_S:-420}
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONDONTWRITEBYTECODE=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export ENGINE_EXTENSIONS_DIR=$WORK/extensions
CONFIG=$ROOT/benchmarks/configs/gpt1b_seq2048_bf16.json
START=$SECONDS
FAILED=0
ROWS=()

left() { echo $((DEADLINE - (SECONDS - START))); }

step() {  # step NAME BOX COMMAND...: run within min(BOX, time left), log to $WORK/NAME.log
    local name=$1 box=$2
    shift 2
    local limit
    limit=$(left)
    [ "$box" -lt "$limit" ] && limit=$box
    if [ "$DRY" = 1 ]; then
        echo "$name (time box ${box}s): $*"
        return 0
    fi
    if [ "$limit" -le 5 ]; then
        ROWS+=("| $name | skipped: deadline | 0 s |")
        return 0
    fi
    echo "== $name (limit ${limit}s)"
    local t0=$SECONDS
    (cd "$WORK" && timeout --kill-after=5 "$limit" "$@") > "$WORK/$name.log" 2>&1
    local rc=$?
    [ "$rc" != 0 ] && FAILED=1
    ROWS+=("| $name | $rc | $((SECONDS - t0)) s |")
    tail -2 "$WORK/$name.log"
}

if [ "$DRY" = 1 ]; then
    echo "dry run: deadline ${DEADLINE}s, work dir (removed) $WORK"
    echo "ops_build (time box 200s, in the background from the start): $PY -m engine.ops --load"
else
    mkdir -p "$OUT"
    (cd "$WORK" && ENGINE_BUILD_OPS=1 timeout --kill-after=5 200 "$PY" -m engine.ops --load > "$WORK/ops_build.log" 2>&1
     echo $? > "$WORK/ops_build.rc") &
    BUILD=$!
fi
step versions 30 "$PY" "$ROOT/benchmarks/gpu_smoke.py" versions --out "$WORK/versions.json"
step smoke 150 "$PY" "$ROOT/benchmarks/gpu_smoke.py" smoke --out "$WORK/smoke.json"
if [ "$DRY" = 0 ]; then
    wait "$BUILD"
    rc=$(cat "$WORK/ops_build.rc" 2>/dev/null || echo 1)
    [ "$rc" != 0 ] && FAILED=1
    ROWS+=("| ops_build | $rc | (background) |")
fi
step gpu_tests 60 "$PY" -m pytest -q -p no:cacheprovider -m gpu "$ROOT/tests/gpu"
step fused 60 "$PY" "$ROOT/benchmarks/gpu_smoke.py" fused --out "$WORK/fused.json"
step adam_kernel 30 "$PY" "$ROOT/benchmarks/kernels/adam.py" --device cuda --no-deepspeed --out "$WORK/adam_kernel.json"
if [ "$DRY" = 1 ] || [ "$(left)" -ge 100 ]; then
    step throughput 100 "$PY" "$ROOT/benchmarks/throughput.py" --config "$CONFIG" \
        --set train_micro_batch_size_per_gpu=4 --set gradient_accumulation_steps=4 --nproc 1 \
        --steps 4 --warmup 2 --split-steps 0 --json "$WORK/throughput.json"
else
    ROWS+=("| throughput | skipped: under 100 s left | 0 s |")
fi

if [ "$DRY" = 1 ]; then
    echo "files left in $OUT: summary.md results.json logs.tar.gz"
    rm -rf "$WORK"
    exit 0
fi

"$PY" - "$WORK" > "$WORK/results.json" <<'PYEOF'
import glob, json, os, sys
work = sys.argv[1]
out = {}
for path in sorted(glob.glob(os.path.join(work, "*.json"))):
    try:
        out[os.path.basename(path)[:-5]] = json.load(open(path))
    except ValueError as e:
        out[os.path.basename(path)[:-5]] = {"unreadable": str(e)}
print(json.dumps(out, indent=1))
PYEOF
{
    echo "# GPU check $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo "| step | exit | time |"
    echo "|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
    echo
    "$PY" - "$WORK/results.json" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
v = r.get("versions", {})
print(f"torch {v.get('torch')}, CUDA {v.get('cuda')}, {v.get('device')} {v.get('capability')}, python {v.get('python')}")
print()
for phase in ("smoke", "fused"):
    for name, c in r.get(phase, {}).get("cases", {}).items():
        figs = {k: c.get(k) for k in ("host_syncs_per_step", "peak_allocated_gib", "seconds")}
        print(f"- {phase}/{name}: {'ok' if c.get('ok') else 'FAILED: ' + str(c.get('error'))} {figs}")
if "fused" in r:
    print(f"- kernels loaded: {r['fused'].get('kernels')}")
t = r.get("throughput", {})
if t:
    print(f"- ~1B throughput: {({k: t.get(k) for k in ('tokens_per_s', 'mfu', 'step_ms')})}")
a = r.get("adam_kernel")
if a:
    print(f"- adam kernel: {json.dumps(a)[:400]}")
PYEOF
} > "$WORK/summary.md"
tar -czf "$WORK/logs.tar.gz" -C "$WORK" $(cd "$WORK" && ls ./*.log)
cp "$WORK/summary.md" "$WORK/results.json" "$WORK/logs.tar.gz" "$OUT/"
rm -rf "$WORK"
cat "$OUT/summary.md"
echo "gpu_check: $([ "$FAILED" = 0 ] && echo passed || echo FAILED) in $((SECONDS - START)) s"
exit $FAILED

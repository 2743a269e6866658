#!/usr/bin/env bash
# What a user of `pip install .` gets: build the wheel, install it (not editable) into a fresh
# virtual environment without the system's site-packages (the editable install's import hook
# there would quietly supply any module the wheel lacks), and use it from outside the checkout:
# every module imports, the CLIs run, and launch/train.py trains 2 steps on 2 ranks.
# Leaves nothing in the checkout (no build/, dist/ or *.egg-info): everything goes to a temp dir.
#
#   .ci/wheel_smoke.sh             (python3 builds the wheel and makes the venv; PYTHON=... to change)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
TORCH_REQ="torch==2.13.0"  # as .ci/run: from pip's cache, installed first so nothing pulls CUDA wheels
WORK="$(cd "$(mktemp -d "${TMPDIR:-/tmp}/engine-wheel-smoke.XXXXXX")" && pwd -P)"
trap 'rm -rf "$WORK"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
unset PYTHONPATH PYTHONHOME PYTHONSTARTUP
started=$SECONDS
step() { echo "[wheel smoke $((SECONDS - started))s] $*"; }

# 1. the wheel; setuptools' build/ and engine.egg-info/ go to $WORK (DIST_EXTRA_CONFIG adds a
#    setup.cfg-style file to setup.py's configuration)
step "building the wheel"
had_before=""
for d in build dist; do
    if [[ -e "$REPO/$d" ]]; then had_before+=" $d"; fi
done
printf '[build]\nbuild_base = %s\n[egg_info]\negg_base = %s\n' "$WORK/build" "$WORK/egg" > "$WORK/build.cfg"
mkdir -p "$WORK/egg"
DIST_EXTRA_CONFIG="$WORK/build.cfg" "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/wheels" "$REPO"
for d in build dist; do
    if [[ -e "$REPO/$d" && " $had_before " != *" $d "* ]]; then
        echo "wheel smoke: building the wheel left $REPO/$d behind" >&2
        exit 1
    fi
done
wheels=("$WORK"/wheels/engine-*.whl)
[[ ${#wheels[@]} -eq 1 && -f "${wheels[0]}" ]] || { echo "wheel smoke: expected one wheel, got: ${wheels[*]}" >&2; exit 1; }

# 2. a fresh venv: torch first, then the wheel (not editable) with its dependencies
step "installing ${wheels[0]##*/} into a fresh venv"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install -q --no-compile "$TORCH_REQ"
"$VPY" -m pip install -q --no-compile "${wheels[0]}"

# 3. from a folder outside the checkout: imports, the shipped op sources, the CLIs
mkdir -p "$WORK/elsewhere" "$WORK/launch"
cd "$WORK/elsewhere"
step "imports"
"$VPY" "$REPO/.ci/wheel_smoke.py" "$REPO"
step "python -m engine.config / engine.ops"
"$VPY" -m engine.config "$REPO/configs/zero1.json" --world-size 2 > resolved.json
"$VPY" -c 'import json, sys; cfg = json.load(open(sys.argv[1])); assert cfg["zero_optimization"]["stage"] == 1, cfg' \
    resolved.json
"$VPY" -m engine.ops | tee ops.txt
grep -q "^sources: $WORK/venv/" ops.txt || { echo "wheel smoke: engine.ops does not find the installed sources" >&2; exit 1; }

# 4. launch/train.py against the installed engine: a copy outside the checkout, since the
#    script puts its checkout on sys.path when it finds engine/ there
step "torchrun --nproc_per_node 2 launch/train.py (2 steps)"
cp "$REPO/launch/train.py" "$WORK/launch/train.py"
STDLIB="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"
cat > "$WORK/tiny.json" <<EOF
{
  "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
  "zero_optimization": {"stage": 1},
  "model": {"vocab_size": 256, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "seq_len": 16},
  "data": {"train_files": ["$STDLIB/textwrap.py"], "cache_dir": "$WORK/data-cache"}
}
EOF
OMP_NUM_THREADS=1 "$WORK/venv/bin/torchrun" --standalone --nproc_per_node 2 "$WORK/launch/train.py" \
    --config "$WORK/tiny.json" --steps 2 --output "$WORK/run" --save "$WORK/ckpt" --sample-tokens 4 --timeout 300
"$VPY" - "$WORK/run/metrics.jsonl" <<'EOF'
import json, math, sys
steps = [json.loads(line) for line in open(sys.argv[1])]
assert [s["step"] for s in steps] == [1, 2], steps
assert all(math.isfinite(s["loss"]) for s in steps), steps
EOF
[[ -n "$(ls -A "$WORK/ckpt")" ]] || { echo "wheel smoke: no checkpoint in $WORK/ckpt" >&2; exit 1; }
step "passed"

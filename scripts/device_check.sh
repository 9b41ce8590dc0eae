#!/usr/bin/env bash
# One-shot check of a CUDA machine (issue 11): install, test, benchmark; every result in one folder.
#
#   bash scripts/device_check.sh [OUT_DIR]      (default: device_check_out; about 5-8 minutes)
#
# 1. installs the project with the cuda and test extras into .venv (jaxlib's CUDA build) and
#    records nvidia-smi and the devices JAX sees;
# 2. runs the tests that exercise the decoding path (model parity, Medusa == plain greedy, batches,
#    dtypes), capped at 4 minutes;
# 3. benchmarks plain against Medusa decoding in bfloat16 with the shipped heads and trees of 4, 16
#    and 64 nodes (small_4, small_16, mc_sim_7b_63 + root) on scripts/device_check_prompts.jsonl
#    (or PROMPTS=FILE), interleaved per prompt by `medusa-bench`;
# 4. writes summary.txt: the devices, the test result and each tree's speed-up and tokens/step.
# A step that fails is recorded and the script goes on; the exit status is 1 if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-device_check_out}
PROMPTS=${PROMPTS:-scripts/device_check_prompts.jsonl}
PY=.venv/bin/python
mkdir -p "$OUT"
status=0
t0=$(date +%s)
log() { echo "[device_check +$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/log.txt"; }
step() {  # step NAME TIMEOUT_S CMD...: run, log its output to OUT/NAME.txt, record failures
    local name=$1 limit=$2; shift 2
    log "$name: $*"
    if timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; then
        log "$name: ok"
    else
        log "$name: FAILED (exit $?; see $OUT/$name.txt)"
        status=1
    fi
}

step install 240 bash -c "make .venv/.base-installed && PYTHONWARNINGS=ignore $PY -m pip install --quiet -e '.[cuda,test]'"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || log "nvidia-smi: not found"
step devices 60 $PY -c "import jax; print(jax.__version__, jax.default_backend(), jax.devices())"
if ! grep -q "gpu\|cuda" "$OUT/devices.txt"; then
    log "JAX sees no GPU (see $OUT/devices.txt): the benchmarks below would measure the CPU"
    status=1
fi
step tests 240 $PY -m pytest -q -x -p no:cacheprovider tests/test_model.py tests/test_medusa.py tests/test_batch.py \
    tests/test_dtype.py
for tree in small_4 small_16 mc_sim_7b_63; do
    step "bench_$tree" 150 $PY -m medusa_jax.cli.bench --prompts "$PROMPTS" --dtype bfloat16 --tree "$tree" \
        --max-new-tokens 128 --out "$OUT/bench_$tree"
done

{
    echo "device check, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(( $(date +%s) - t0 )) s"
    head -1 "$OUT/devices.txt" 2>/dev/null
    echo "tests: $(tail -1 "$OUT/tests.txt" 2>/dev/null)"
    for tree in small_4 small_16 mc_sim_7b_63; do
        echo "== $tree (bfloat16, shipped heads)"
        grep -E "^\| (overall|all) |tokens/step: measured|identical" "$OUT/bench_$tree.txt" 2>/dev/null
    done
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
exit $status

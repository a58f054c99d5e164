#!/usr/bin/env bash
# The GPU proof in one command (issue 20): everything the GPU path claims,
# run on one CUDA machine in under 9 minutes, from the checkout, with no
# Ray, no network and no install.
#
#   bash bench/gpu_proof.sh [DIR]          # results in DIR, else $OUT, else bench/results/gpu_proof
#   bash bench/gpu_proof.sh --smoke [DIR]  # the same steps on the CPU at tiny sizes (CI); the
#                                          # test-file steps only collected (the suite runs them)
#
# Steps, each under its own time limit, each reported as soon as it ends.
# First the essentials, one at a time (under 5 minutes with setup): greedy
# parity with transformers in float32 on CUDA (graphs, eager, chunked
# prefill, the host KV tier, n-gram speculation) and the bf16 logprob
# tolerance; the decode roofline at batch 64 with CUDA graphs; throughput
# against transformers (qwen3-0.6b preset). Then the Triton kernel tests at
# full size (attention, KV write, the fused elementwise kernels), the
# attention-backend, CUDA-graph, GPU-setup and Ray-free test files side by
# side, the roofline at batch 256 with graphs, the roofline in eager mode and
# the attention kernel alone across its launch choices. No step runs past GPU_PROOF_BUDGET_S (500 s) from
# the start. A failing step is recorded and the next one runs.
# GPU_PROOF_STEPS=kernels,throughput runs only those steps (to re-run what
# failed). GPU_PROOF_PROFILE=1 adds each roofline step's torch.profiler and
# cProfile tables (data/NAME.profile.txt), to see where a step off its
# floor spends its time.
#
# Output: summary.md (each step's status, wall time and note, with the
# versions), tables.md (every table the benches printed), versions.txt, and
# each step's log and raw output under logs/, tables/, data/. When DIR is
# $OUT (the device tool's folder, which returns at most 8 files), those
# three folders are packed into steps.tar.gz after every step
# (GPU_PROOF_PACK=0/1 overrides).
#
# Imports come from the checkout: bench/srcpath goes on PYTHONPATH, and its
# sitecustomize maps rayvllm.kernels and rayvllm.actors as `pip install -e .`
# would; `pip install --no-build-isolation --no-deps -e .` is the fallback.
# pydantic, which the engine needs and that machine's image lacks, is
# installed from .whl/ when it is missing there (bench/gpu_wheels.sh fetches
# the wheels; the device call carries .whl).
set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
SMOKE=${GPU_PROOF_SMOKE:-0}
DEST=""
for arg in "$@"; do
    case $arg in
        --smoke) SMOKE=1 ;;
        -h|--help) sed -n '2,37p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) DEST=$arg ;;
    esac
done
PACK_DEFAULT=0
if [ -z "$DEST" ]; then
    if [ -n "${OUT:-}" ]; then DEST=$OUT; PACK_DEFAULT=1; else DEST=$REPO/bench/results/gpu_proof; fi
fi
PACK=${GPU_PROOF_PACK:-$PACK_DEFAULT}
PY=${PYTHON:-python3}
BUDGET_S=${GPU_PROOF_BUDGET_S:-500}
# A comma-separated subset of the steps below (setup always runs), to re-run what failed.
ONLY=${GPU_PROOF_STEPS:-}
# Smoke runs share a small CI machine: the limits there only catch hangs.
SCALE=1
[ "$SMOKE" = 1 ] && SCALE=4
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_proof.XXXXXX")
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd -P)
# Each step's raw output (logs/, tables/, data/): beside the summary, or,
# when packing, in a scratch folder packed into DEST after every step, so
# that a run killed at its limit still returns every result it has.
RAW=$DEST
[ "$PACK" = 1 ] && RAW=$WORK/raw
mkdir -p "$RAW/logs" "$RAW/tables" "$RAW/data"
# Each step's record: one line of `name status wall_s limit_s note` in
# data/steps/NAME.tsv (tests run side by side, so one file each).
STEPS=$RAW/data/steps
mkdir -p "$STEPS"
# The essentials first (parity, the decode roofline at batch 64 with
# graphs, throughput against transformers), then the rest.
ORDER=(setup gpu-parity roofline-graphs throughput kernels attention-backends cuda-graph gpu-setup ray-free
       roofline-graphs-256 roofline-eager attention-sweep)
START=$(date +%s)

export PYTHONPATH="$REPO/bench/srcpath${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RAYVLLM_BENCH_CACHE=${RAYVLLM_BENCH_CACHE:-$WORK/cache}
cd "$REPO" || exit 1

say() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }

# record NAME STATUS WALL_S LIMIT_S NOTE
record() {
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" > "$STEPS/$1.tsv"
    say "$1: $2 (${3}s) $5"
}

skip() { record "$1" skipped 0 - "$2"; }

# run_limited NAME LIMIT_S OUTFILE CMD...: runs CMD under `timeout` (which
# kills its whole process group, engine children included), stdout to
# OUTFILE and stderr to logs/NAME.log (the same file for pytest); sets
# RC, WALL and LIMIT. Returns 1 without running when the budget is spent.
run_limited() {
    local name=$1 limit=$(( $2 * SCALE )) outfile=$3
    shift 3
    local left=$(( BUDGET_S * SCALE - ($(date +%s) - START) ))
    if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then
        skip "$name" "not in GPU_PROOF_STEPS=$ONLY"
        return 1
    fi
    if [ "$left" -lt 10 ]; then
        skip "$name" "out of the time budget (GPU_PROOF_BUDGET_S=$BUDGET_S)"
        return 1
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "$name: running (limit ${limit}s): $*"
    local t0 t1
    t0=$(date +%s.%N)
    if [ "$outfile" = "$RAW/logs/$name.log" ]; then
        timeout -k 5 "$limit" "$@" < /dev/null > "$outfile" 2>&1
    else
        timeout -k 5 "$limit" "$@" < /dev/null > "$outfile" 2> "$RAW/logs/$name.log"
    fi
    RC=$?
    t1=$(date +%s.%N)
    WALL=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
    LIMIT=$limit
    return 0
}

status_of() {  # status_of RC
    case $1 in
        0) echo passed ;;
        124|137) echo timeout ;;
        *) echo "failed (rc $1)" ;;
    esac
}

# pytest_step NAME LIMIT_S FILE [PYTEST ARGS...]
pytest_step() {
    local name=$1 limit=$2 file=$3
    shift 3
    if [ "$HAVE_PYTEST" != 1 ]; then skip "$name" "pytest is not installed"; return; fi
    local log=$RAW/logs/$name.log
    # The project's addopts (two xdist workers for the suite) stay out: the
    # GPU machine may lack xdist, and a step picks its own -n. No step's
    # tests use hypothesis, whose plugin takes a second to import.
    run_limited "$name" "$limit" "$log" "$PY" -m pytest -q -rfEs -p no:cacheprovider -p no:hypothesispytest \
        -o addopts= "${COLLECT_ONLY[@]}" "$file" "$@" \
        || return
    # pytest's last line: "3 passed, 2 skipped in 4.1s", "8/61 tests
    # collected (53 deselected) in 0.5s" (or "no tests ran").
    local counts status
    counts=$(grep -E '[0-9]+ (passed|failed|skipped|error|errors|deselected)|[0-9]+ tests? collected|no tests ran' \
        "$log" | tail -n 1 | sed -E 's/=+//g; s/^ +//; s/ +$//; s/ in [0-9.]+s.*$//')
    status=$(status_of "$RC")
    if [ "$RC" = 0 ] && [ "$SMOKE" = 1 ]; then
        status=collected
    elif [ "$RC" = 0 ] && ! grep -q passed <<< "$counts"; then
        status=skipped
    fi
    [ "$RC" = 5 ] && status="failed (no tests ran)"
    [ "$status" = timeout ] && counts="killed at its ${LIMIT} s limit; $(grep -cE '(PASSED|FAILED|ERROR)' "$log") results logged"
    record "$name" "$status" "$WALL" "$LIMIT" "$counts"
}

# bench_step NAME LIMIT_S CMD...: the command's stdout (its table) goes to tables/NAME.txt.
bench_step() {
    local name=$1 limit=$2
    shift 2
    run_limited "$name" "$limit" "$RAW/tables/$name.txt" "$@" || return
    local note status
    # The targets' verdicts (GPU), else throughput's rates.
    note=$( (grep -E '^target ' "$RAW/tables/$name.txt" | sed -E 's/: step <=.*graphs: / /'
             awk '/^(rayvllm|transformers) +[0-9]/ { print $1 " " $4 " tok/s" }' "$RAW/tables/$name.txt") \
        | tr '\n' ';' | sed 's/;$//')
    status=$(status_of "$RC")
    if [ "$status" = timeout ]; then
        note="killed at its ${LIMIT} s limit: $(tail -n 1 "$RAW/logs/$name.log")"
    elif [ "$RC" != 0 ]; then
        note="$(tail -n 1 "$RAW/logs/$name.log")"
    elif grep -q ' error: ' "$RAW/tables/$name.txt"; then
        # throughput.py reports a failed engine child in its table and exits 0.
        status="failed (an engine errored)"
        note="$(grep ' error: ' "$RAW/tables/$name.txt" | head -n 1 | tr -s ' ')"
    fi
    record "$name" "$status" "$WALL" "$LIMIT" "$note"
}

# ---------------------------------------------------------------- setup
say "gpu_proof: repo $REPO, results in $DEST, smoke=$SMOKE"
t_setup=$(date +%s)
setup_notes=()
if ! command -v "$PY" > /dev/null; then
    skip setup "no $PY on PATH: nothing can run"
    exit 1
fi
# pydantic 2 (the engine's EngineArgs) from carried wheels, where missing.
if ! timeout 20 "$PY" -c 'import sys, pydantic; sys.exit(int(pydantic.VERSION.split(".")[0]) < 2)' 2> /dev/null; then
    if ls "$REPO"/.whl/*.whl > /dev/null 2>&1; then
        # Our wheels go first on PYTHONPATH: a typing_extensions already there
        # and new enough for pydantic is kept rather than shadowed by ours.
        te_ok=0
        timeout 20 "$PY" -c 'import sys; from importlib.metadata import version
sys.exit(tuple(map(int, version("typing_extensions").split(".")[:3])) < (4, 14, 1))' 2> /dev/null && te_ok=1
        wheels=()
        for w in "$REPO"/.whl/*.whl; do
            [ "$te_ok" = 1 ] && [[ $(basename "$w") == typing_extensions-* ]] && continue
            wheels+=("$w")
        done
        timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" \
            "${wheels[@]}" > "$RAW/logs/setup-wheels.log" 2>&1 \
            && export PYTHONPATH="$WORK/site:$PYTHONPATH" \
            && setup_notes+=("pydantic installed from .whl/")
    else
        setup_notes+=("pydantic 2 missing and no .whl/ (run bench/gpu_wheels.sh where pip works, carry .whl)")
    fi
fi
write_versions() {
    {
        echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
        echo "commit: $(git -C "$REPO" rev-parse HEAD 2> /dev/null || echo 'unknown (no .git)')"
        echo "command: bash bench/gpu_proof.sh $*"
        if command -v nvidia-smi > /dev/null; then
            echo "nvidia-smi: $(timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
                --format=csv,noheader 2>&1 | tr '\n' ';')"
            echo "driver $(timeout 20 nvidia-smi 2>&1 | grep -o 'CUDA Version: [0-9.]*' | head -n 1)"
        else
            echo "nvidia-smi: not found"
        fi
        command -v nvcc > /dev/null && echo "nvcc: $(nvcc --version | tail -n 2 | tr '\n' ' ')"
        timeout 90 "$PY" bench/gpu_env.py 2>&1
    } > "$DEST/versions.txt"
}
from_checkout() { grep -qxF "rayvllm.kernels from: $REPO/kernels/__init__.py" "$DEST/versions.txt"; }
write_versions "$@"
if ! from_checkout; then
    if [ "$SMOKE" != 1 ] && timeout 60 "$PY" -m pip install -q --no-build-isolation --no-deps -e "$REPO" \
            > "$RAW/logs/setup-pip.log" 2>&1 && write_versions "$@" && from_checkout; then
        setup_notes+=("imports via pip install --no-build-isolation -e .")
    else
        setup_notes+=("$(grep '^rayvllm.kernels from:' "$DEST/versions.txt"), not the checkout's")
    fi
fi
command -v nvidia-smi > /dev/null && timeout 20 nvidia-smi > "$RAW/logs/nvidia-smi.log" 2>&1
HAVE_PYTEST=0
grep -q '^pytest: [0-9]' "$DEST/versions.txt" && HAVE_PYTEST=1
HAVE_CUDA=0
grep -q '^CUDA device 0:' "$DEST/versions.txt" && HAVE_CUDA=1
ENGINE_OK=0
if grep -q '^engine import: ok$' "$DEST/versions.txt"; then
    ENGINE_OK=1
else
    setup_notes+=("$(grep '^engine import:' "$DEST/versions.txt" || echo 'engine import: no answer')")
fi
# pytest-xdist, where present, compiles the kernel tests' Triton variants in parallel.
XDIST_KERNELS=() XDIST_PARITY=()
if [ "$SMOKE" != 1 ] && grep -q '^xdist: [0-9]' "$DEST/versions.txt"; then XDIST_KERNELS=(-n 6) XDIST_PARITY=(-n 3); fi
setup_status=passed
[ "$ENGINE_OK" = 1 ] || setup_status=failed
record setup "$setup_status" "$(( $(date +%s) - t_setup ))" - "$(IFS=';'; echo "${setup_notes[*]:-imports from the checkout}")"

# ---------------------------------------------------------------- report
# report [final]: summary.md and tables.md from the steps recorded so far
# (a step not yet run shows as 'not run'), and, when packing, the raw
# outputs as steps.tar.gz. Called after every step, so that whatever ends
# the run, what it has measured is already in DEST.
report() {
    local total=$(( $(date +%s) - START ))
    {
        echo "# GPU proof: $([ "$SMOKE" = 1 ] && echo 'CPU smoke run' || echo 'full run')"
        echo
        echo '```'
        grep -E '^(date|commit|nvidia-smi|driver CUDA|nvcc|python|torch|triton|transformers|pydantic|CUDA device)' \
            "$DEST/versions.txt"
        grep -E '^(rayvllm.kernels from|engine import):' "$DEST/versions.txt"
        echo '```'
        echo
        echo "Wall time ${total} s $([ "${1:-}" = final ] && echo 'in all' || echo 'so far') (budget ${BUDGET_S} s x ${SCALE})."
        echo
        echo "| step | status | wall s | limit s | note |"
        echo "| --- | --- | --- | --- | --- |"
        local step name status wall limit note
        for step in "${ORDER[@]}"; do
            if [ -f "$STEPS/$step.tsv" ]; then
                IFS=$'\t' read -r name status wall limit note < "$STEPS/$step.tsv"
                echo "| $name | $status | $wall | $limit | ${note//|//} |"
            else
                echo "| $step | not run | - | - | the script ended before it |"
            fi
        done
    } > "$DEST/summary.md.tmp" && mv "$DEST/summary.md.tmp" "$DEST/summary.md"
    {
        echo "# Tables printed by the benches"
        local f
        for name in "${ORDER[@]}"; do
            f=$RAW/tables/$name.txt
            [ -s "$f" ] || continue
            echo
            echo "## $name"
            echo
            echo '```'
            cat "$f"
            echo '```'
        done
    } > "$DEST/tables.md.tmp" && mv "$DEST/tables.md.tmp" "$DEST/tables.md"
    if [ "$PACK" = 1 ]; then
        tar -czf "$DEST/steps.tar.gz.tmp" -C "$RAW" logs tables data && mv "$DEST/steps.tar.gz.tmp" "$DEST/steps.tar.gz"
    fi
}
report

# ---------------------------------------------------------------- steps
# Smoke mode: pytest -k selections and bench sizes small enough for CI.
if [ "$SMOKE" = 1 ]; then
    # The suite runs these very test files; here they are only collected,
    # which proves each step's file and -k selection as the GPU run uses them.
    COLLECT_ONLY=(--collect-only)
    K_KERNELS=(-k "split4-decode-f32-bs8 or num_kv_splits or tiles_per_head_size")
    K_BACKENDS=(-k "test_auto_picks_by_device_and_availability")
    K_GRAPHS=(-k "test_capture_sizes or test_padded_size")
    K_SETUP=(-k "test_kv_cache_budget_arithmetic")
    DEVICE=cpu
    B_FIRST=2 B_LATER=3
    ROOFLINE=(--preset tiny --context-len 12 --steps 2 --warmup-steps 1 --copy-mib 8 --gemm-divisor 8)
    SWEEP=(--batch-sizes 2 --context-len 20 --splits 1,2 --block-n 16 --iters 1 --copy-mib 8)
    THROUGHPUT=(--preset tiny --engines rayvllm,transformers --num-seqs 4 --min-len 8 --max-len 16)
else
    COLLECT_ONLY=()
    K_KERNELS=() K_BACKENDS=() K_GRAPHS=() K_SETUP=()
    DEVICE=cuda
    B_FIRST=64 B_LATER=256
    ROOFLINE=(--preset qwen3-0.6b)
    SWEEP=()
    # Issue 5's request shape (100-1024 tokens in and out) on 128 requests,
    # one timed round, transformers as one static batch of all 128 (its
    # round alone takes over two minutes on an H100: the child's limit
    # leaves room for that and its load). Fewer requests batch less for
    # rayvllm too, so the ratio errs against us.
    THROUGHPUT=(--preset qwen3-0.6b --num-seqs 128 --min-len 100 --max-len 1024 --max-model-len 2048
                --hf-batch 128 --repeats 1 --timeout 200)
fi
BENCH_OK=1
BENCH_WHY=""
if [ "$SMOKE" != 1 ] && [ "$HAVE_CUDA" != 1 ]; then BENCH_OK=0; BENCH_WHY="no CUDA device (--smoke runs the CPU sizes)"; fi
[ "$ENGINE_OK" = 1 ] || { BENCH_OK=0; BENCH_WHY="the engine does not import (see setup)"; }
ENGINE_WHY="the engine does not import (see setup)"

# roofline NAME LIMIT_S BATCH_SIZES [ARGS...]
roofline() {
    local name=$1 limit=$2 sizes=$3
    local PROFILE_ARGS=()
    [ "${GPU_PROOF_PROFILE:-0}" = 1 ] && PROFILE_ARGS=(--profile-out "$RAW/data/$name.profile.txt")
    shift 3
    if [ "$BENCH_OK" != 1 ]; then skip "$name" "$BENCH_WHY"; return; fi
    bench_step "$name" "$limit" "$PY" bench/decode_roofline.py --device "$DEVICE" "${ROOFLINE[@]}" \
        --batch-sizes "$sizes" "$@" --json-out "$RAW/data/$name.json" "${PROFILE_ARGS[@]}"
}

# The essentials, one at a time, each reported as it ends: greedy parity
# (float32, bf16 tolerance, the host KV tier, n-gram speculation), the
# decode roofline at batch 64 with CUDA graphs, throughput against
# transformers. Under 5 minutes with setup. A smoke run (CI) runs every
# step one at a time too: it shares two cores with the rest of the suite,
# where steps side by side only cost more CPU in all; its report comes at
# the end.
ordered() {
    "$@"
    [ "$SMOKE" = 1 ] || report
}
# side STEP...: the test files run side by side on the GPU machine's cores.
side() {
    if [ "$SMOKE" = 1 ]; then "$@"; else "$@" & fi
}
if [ "$ENGINE_OK" != 1 ]; then
    skip gpu-parity "$ENGINE_WHY"
elif [ "$SMOKE" = 1 ] && [ "$HAVE_CUDA" != 1 ]; then
    # Every parity test needs CUDA; the suite collects the file, so a CPU
    # smoke run spends no pytest process on skipping them.
    skip gpu-parity "no CUDA device: every parity test needs one"
else
    ordered pytest_step gpu-parity 90 tests/test_gpu_parity.py "${XDIST_PARITY[@]}"
fi
ordered roofline roofline-graphs 60 "$B_FIRST"
if [ "$BENCH_OK" = 1 ]; then
    ordered bench_step throughput 250 "$PY" bench/throughput.py --device "$DEVICE" "${THROUGHPUT[@]}" \
        --log-dir "$RAW/logs/throughput" --json-out "$RAW/data/throughput.json"
else
    skip throughput "$BENCH_WHY"
fi

# Then the other tests, side by side (none times anything; together they
# take what the slowest takes), and the remaining benches alone.
side pytest_step kernels 120 tests/test_triton_kernels.py tests/test_triton_fused.py "${XDIST_KERNELS[@]}" "${K_KERNELS[@]}"
if [ "$ENGINE_OK" = 1 ]; then
    side pytest_step attention-backends 120 tests/test_attention_backends.py "${K_BACKENDS[@]}"
    side pytest_step cuda-graph 120 tests/test_cuda_graph.py "${K_GRAPHS[@]}"
    side pytest_step gpu-setup 120 tests/test_gpu_setup.py "${K_SETUP[@]}"
    side pytest_step ray-free 90 tests/test_ray_free.py
else
    for name in attention-backends cuda-graph gpu-setup ray-free; do skip "$name" "$ENGINE_WHY"; done
fi
[ "$SMOKE" = 1 ] || { wait; report; }
ordered roofline roofline-graphs-256 60 "$B_LATER"
ordered roofline roofline-eager 75 "$B_FIRST,$B_LATER" --enforce-eager
if [ "$BENCH_OK" = 1 ]; then
    ordered bench_step attention-sweep 90 "$PY" bench/attention_sweep.py --device "$DEVICE" "${SWEEP[@]}" \
        --json-out "$RAW/data/attention-sweep.json"
else
    skip attention-sweep "$BENCH_WHY"
fi
wait
report final

FAILED=0
grep -qE '^\| [a-z0-9-]+ \| (failed|timeout|not run)' "$DEST/summary.md" && FAILED=1
rm -rf "$WORK"
cat "$DEST/summary.md"
exit "$FAILED"

#!/usr/bin/env bash
# GPU check for kvcache_ggml: build ggml-python with CUDA, compare the KV cache on CUDA with the CPU, time it.
#
#   scripts/gpu_check.sh            (from anywhere; runs in the repository root)
#
# For a machine with an NVIDIA GPU and no network. It needs, besides the repository:
#   - the CUDA toolkit with cuBLAS (nvcc on PATH or in /usr/local/cuda*/bin; cublas_v2.h and libcublas),
#     cmake >= 3.21, gcc/g++;
#   - vendor/ggml_python-0.0.45.tar.gz (build.py checks its sha256 and unpacks it; no download when present);
#   - .venv/ from a previous `python3 build.py` (build.py only creates it -- with pip and the network -- when it is
#     missing or was made by another Python minor version).
# Steps (each with its own time limit, all within GPU_CHECK_BUDGET seconds, default 570):
#   1. python3 build.py --cuda --cuda-arch ${CUDA_ARCH:-90} --jobs $(nproc)    (incremental per flag set)
#   2. python -m kvcache_ggml info                         (must list a CUDA device)
#   3. python -m kvcache_ggml parity --backends cuda        (the parity trace, CPU vs CUDA, f16/q8_0/f32 caches)
#   4. python -m kvcache_ggml parity --bench --backends cuda,cpu   (model-sized cache timings)
# GPU_CHECK_BACKEND=rpc runs steps 2-4 with a loopback RPC server instead of CUDA and no build (a dry run of the
# script on any machine); GPU_CHECK_BENCH_ARGS adds options to step 4 (e.g. "--bench-kv-size 1024").
# Results: $OUT/gpu_check.md (or ./gpu_check_results/gpu_check.md when OUT is unset) with the full log next to
# it; the results table is printed last. Exit status: 0 when every step ran and parity passed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
T0=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET:-570}
ARCH=${CUDA_ARCH:-90}
BACKEND=${GPU_CHECK_BACKEND:-cuda}   # another backend (rpc) runs steps 3-4 without a build: a dry run of the script
JOBS=$(nproc)
DEST=${OUT:-$ROOT/gpu_check_results}
mkdir -p "$DEST"
LOG="$DEST/gpu_check.log"
RES="$DEST/gpu_check.md"
PY="$ROOT/.venv/bin/python"
: >"$LOG"

left() { echo $((BUDGET - ($(date +%s) - T0))); }
say() { echo "[gpu_check $(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }
declare -a STEPS=()
step() { STEPS+=("| $1 | $2 | $3 s |"); }   # name, status, seconds
fail=0

# run NAME LIMIT_S OUTFILE CMD... : run with a time limit, keep stdout+stderr in OUTFILE and the log
run() {
    local name=$1 limit=$2 out=$3
    shift 3
    if ((limit < 10)); then
        say "$name: skipped, time budget spent"
        step "$name" "skipped (no time left)" 0
        fail=1
        return 1
    fi
    say "$name: $* (limit ${limit}s)"
    local t=$(date +%s) rc
    timeout --kill-after=10 "$limit" "$@" >"$out" 2>&1
    rc=$?
    cat "$out" >>"$LOG"
    local dt=$(($(date +%s) - t))
    if ((rc == 124 || rc == 137)); then
        step "$name" "TIMEOUT after ${limit}s" "$dt"
        say "$name: timed out"
        fail=1
    elif ((rc != 0)); then
        step "$name" "exit $rc" "$dt"
        say "$name: exit $rc; last lines:"
        tail -n 15 "$out" | tee -a "$LOG"
        fail=1
    else
        step "$name" "ok" "$dt"
    fi
    return $rc
}

# ---- preflight ------------------------------------------------------------------------------------------------
if ! command -v nvcc >/dev/null; then
    for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
        [[ -x "$d/nvcc" ]] && export PATH="$d:$PATH" && break
    done
fi
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)
NVCC=$(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' | head -n 1)
# the toolkit root: nvcc may be a wrapper script, so ask nvcc itself (its dry run prints TOP=<root>/bin/..)
CUDA_ROOT=$(nvcc --dryrun -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=\(.*\)\/bin\/\.\.$/\1/p' | head -n 1)
have_cublas() {
    local d
    for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" "$CUDA_ROOT" /usr/local/cuda /usr/local/cuda-* /usr; do
        [[ -n "$d" ]] || continue
        compgen -G "$d/include/cublas_v2.h" >/dev/null && return 0
        compgen -G "$d/targets/*/include/cublas_v2.h" >/dev/null && return 0
    done
    return 1
}
say "GPU: ${GPU:-none found by nvidia-smi}; nvcc: ${NVCC:-not found} (${CUDA_ROOT:-?}); ${JOBS} cores;" \
    "budget ${BUDGET}s; backend: $BACKEND"
missing=()
if [[ "$BACKEND" == cuda ]]; then
    [[ -n "$GPU" ]] || missing+=("an NVIDIA GPU (nvidia-smi finds none)")
    [[ -n "$NVCC" ]] || missing+=("nvcc (CUDA toolkit)")
    [[ -z "$NVCC" ]] || have_cublas ||
        missing+=("cuBLAS (no cublas_v2.h under ${CUDA_ROOT:-the CUDA toolkit}): ggml's CUDA backend links it")
    command -v cmake >/dev/null || missing+=("cmake >= 3.21")
fi
[[ -f vendor/ggml_python-0.0.45.tar.gz || -f vendor/ggml/ggml_python-0.0.45/.unpacked ]] ||
    missing+=("vendor/ggml_python-0.0.45.tar.gz (the ggml-python source package; no network to fetch it)")
[[ -x "$PY" ]] || missing+=(".venv/ (created by 'python3 build.py' with network access; carry it over)")
if ((${#missing[@]})); then
    for m in "${missing[@]}"; do say "missing: $m"; done
    step preflight "missing: $(IFS=';'; echo "${missing[*]}")" "$(($(date +%s) - T0))"
    fail=1
else
    step preflight ok "$(($(date +%s) - T0))"
fi

# ---- 1. build ------------------------------------------------------------------------------------------------
BUILD_OK=0
if ((fail == 0)) && [[ "$BACKEND" != cuda ]]; then
    say "backend $BACKEND: no CUDA build (dry run of the checks)"
    BUILD_OK=1
elif ((fail == 0)); then
    # leave at least 150 s for the checks after the build
    run "build (CUDA arch $ARCH, $JOBS jobs)" $(($(left) - 150)) "$DEST/build.txt" \
        python3 build.py --cuda --cuda-arch "$ARCH" --jobs "$JOBS" --quiet && BUILD_OK=1
    [[ -f vendor/build.log ]] && cp vendor/build.log "$DEST/ggml_build.log"
fi

# ---- 2. devices ----------------------------------------------------------------------------------------------
if ((BUILD_OK)); then
    run "devices" 60 "$DEST/info.txt" "$PY" -m kvcache_ggml info
    if [[ "$BACKEND" == cuda ]] && ! grep -q "device CUDA" "$DEST/info.txt"; then
        say "the CUDA build lists no CUDA device"
        step "CUDA device" "none listed (see info.txt)" 0
        BUILD_OK=0
        fail=1
    fi
fi

# ---- 3. parity, 4. benchmarks --------------------------------------------------------------------------------
if ((BUILD_OK)); then
    run "parity CPU vs $BACKEND" $(($(left) > 240 ? 240 : $(left) - 60)) "$DEST/parity.txt" \
        "$PY" -m kvcache_ggml parity --backends "$BACKEND" --types f16,q8_0,f32 --threads "$JOBS"
    run "benchmarks ($BACKEND, CPU baseline)" $(($(left) - 15)) "$DEST/bench.txt" \
        "$PY" -m kvcache_ggml parity --bench --backends "$BACKEND,cpu" --types f16,q8_0 --threads "$JOBS" \
        --bench-reps 3 ${GPU_CHECK_BENCH_ARGS:-}
fi

# ---- results -------------------------------------------------------------------------------------------------
{
    echo "# kvcache_ggml GPU check"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "- GPU: ${GPU:-none}; nvcc: ${NVCC:-none}; CUDA arch: $ARCH; $JOBS cores"
    echo "- ggml: $(grep -m1 '^ggml ' "$DEST/info.txt" 2>/dev/null || echo 'not built')"
    echo "- total: $(($(date +%s) - T0)) s of a ${BUDGET} s budget"
    echo
    echo "| step | status | time |"
    echo "|---|---|---|"
    printf '%s\n' "${STEPS[@]}"
    for part in parity bench; do
        f="$DEST/$part.txt"
        [[ -s "$f" ]] || continue
        echo
        echo "## $part"
        echo
        # the tables and the lines that follow them (placements, skips, tolerances, failures)
        sed -n '/^| backend/,$p' "$f"
    done
} >"$RES"
say "results in $RES (log: $LOG)"
echo
cat "$RES"
exit $fail

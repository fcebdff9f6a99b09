#!/usr/bin/env bash
# GPU check for kvcache_ggml: build ggml-python with CUDA from the carried source package, compare the KV cache and
# the runtime on CUDA with the CPU, and time a decode step -- in one call on a bare machine with no network.
#
#   scripts/gpu_check.sh            (from anywhere; works in the repository root)
#   scripts/gpu_check.sh --plan     print the carried files it installs, in order, after checking them; exit
#
# Needs, besides the repository: .carry/ (`python3 build.py carry` fills it: the ggml-python sdist, the pure-Python
# wheels the machine lacks, MANIFEST with their sha256); a python3 (>= 3.10) with numpy, scikit-build-core, cmake
# and ninja, pyyaml, requests, tqdm, typing-extensions; for CUDA: nvcc, cuBLAS (the toolkit's, or the nvidia-cublas
# wheel on python3's path) and an NVIDIA GPU. Nothing is downloaded: pip runs with --no-index and no config file.
#
# Steps (each with its own time limit, all within GPU_CHECK_BUDGET seconds, default 560):
#   preflight  tools, GPU, the carried files against MANIFEST
#   venv       python3 -m venv --system-site-packages --without-pip (pip is python3's own, run with --python);
#              when python3 is itself a venv, a .pth file adds its site-packages (a venv made from a venv sees only
#              the base interpreter's)
#   wheels     pip install --no-index --no-build-isolation --find-links .carry <the carried wheels>
#   ggml       pip install --no-index --no-build-isolation of the unpacked sdist, CMAKE_ARGS from
#              `build.py --cuda --cuda-arch $CUDA_ARCH cmake-args`, $(nproc) jobs, build folder kept in .gpu_check/
#              (a rerun on the same machine is incremental; with the same arguments it is skipped)
#   devices    python -m kvcache_ggml info lists the backend's device
#   parity     python -m kvcache_ggml parity: the cache, CUDA vs CPU, f16/q8_0/f32 caches
#   runtime    python -m kvcache_ggml runtime-parity: logits and greedy tokens, tiny F32 and Q8_0 llama models, 12
#              steps (GPU_CHECK_RUNTIME_ARGS replaces those options: '--steps 64' runs every model of MODELS)
#   steps      python -m kvcache_ggml step-times: host time per decode step beside the compute time, 1 and 8 seqs
#   bench      (extra, when time is left) python -m kvcache_ggml parity --bench: a model-sized cache's graph ops
# Environment: GPU_CHECK_BACKEND=rpc builds ggml with CPU + RPC (no CUDA) and checks a loopback RPC server instead:
# the dry run of the whole script on any machine. GPU_CHECK_PYTHON (python3), GPU_CHECK_WORK (.gpu_check),
# GPU_CHECK_CARRY (.carry), CUDA_ARCH (90), GPU_CHECK_STEP_ARGS / GPU_CHECK_BENCH_ARGS (more options for step-times /
# parity --bench).
# Results: $OUT (or ./gpu_check_results) gets gpu_check.md (the tables), gpu_check.log (every step's output),
# ggml_build.log and ninja_log.txt (per-file compile times); the results are printed last. Exit status 0 when every
# step but the extra one ran and passed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
T0=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET:-560}
BACKEND=${GPU_CHECK_BACKEND:-cuda}
ARCH=${CUDA_ARCH:-90}
PY=${GPU_CHECK_PYTHON:-python3}
WORK=${GPU_CHECK_WORK:-$ROOT/.gpu_check}
CARRY=${GPU_CHECK_CARRY:-$ROOT/.carry}
VENV="$WORK/venv"
VPY="$VENV/bin/python"
JOBS=$(nproc)

# pip sees the carried files and nothing else: no index, no configuration of this machine
export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_NO_INPUT=1
unset PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_CONSTRAINT PIP_REQUIRE_VIRTUALENV PIP_USER

# the carried files in install order (wheels, then the sdist), after `sha256sum -c` of MANIFEST
carried_files() {
    [[ -f "$CARRY/MANIFEST" ]] || { echo "no $CARRY/MANIFEST: run 'python3 build.py carry' first" >&2; return 1; }
    (cd "$CARRY" && sha256sum --check --quiet --strict MANIFEST) >&2 || {
        echo "files in $CARRY do not match its MANIFEST" >&2; return 1; }
    awk '{print $2}' "$CARRY/MANIFEST"
}

if [[ "${1:-}" == "--plan" ]]; then
    carried_files
    exit
fi

DEST=${OUT:-$ROOT/gpu_check_results}
mkdir -p "$DEST" "$WORK/out"
LOG="$DEST/gpu_check.log"
RES="$DEST/gpu_check.md"
: >"$LOG"

left() { echo $((BUDGET - ($(date +%s) - T0))); }
say() { echo "[gpu_check $(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }
declare -a STEPS=()
step() { STEPS+=("| $1 | $2 | $3 s | $4 |"); }   # name, status, seconds, limit
fail=0

# run NAME LIMIT CMD... : with a time limit; output in $WORK/out/NAME.txt and the log; sets fail on failure
run() {
    local name=$1 limit=$2
    shift 2
    local out="$WORK/out/$name.txt"
    : >"$out"
    if ((limit < 10)); then
        say "$name: skipped, time budget spent"
        step "$name" "skipped (no time left)" 0 "$limit s"
        fail=1
        return 1
    fi
    say "$name: $* (limit ${limit}s)"
    local t=$(date +%s) rc
    # a shell function (exported) runs in a child bash, so that timeout can stop it
    timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@" >"$out" 2>&1
    rc=$?
    { echo "---- $name (exit $rc)"; cat "$out"; } >>"$LOG"
    local dt=$(($(date +%s) - t))
    if ((rc == 124 || rc == 137)); then
        step "$name" "TIMEOUT" "$dt" "$limit s"
        say "$name: timed out after ${dt}s"
        fail=1
    elif ((rc != 0)); then
        step "$name" "exit $rc" "$dt" "$limit s"
        say "$name: exit $rc after ${dt}s; last lines:"
        tail -n 15 "$out" | tee -a "$LOG"
        fail=1
    else
        step "$name" ok "$dt" "$limit s"
        say "$name: ok in ${dt}s"
    fi
    return $rc
}

cap() { local a=$1 b=$2; echo $((a < b ? a : b)); }

# ---- preflight ------------------------------------------------------------------------------------------------
if ! command -v nvcc >/dev/null; then
    for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
        [[ -x "$d/nvcc" ]] && export PATH="$d:$PATH" && break
    done
fi
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)
NVCC=$(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' | head -n 1)
PYV=$("$PY" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null)
PIPV=$("$PY" -m pip --version 2>/dev/null | awk '{print $2}')
say "backend $BACKEND; GPU: ${GPU:-none found by nvidia-smi}; nvcc: ${NVCC:-not found}; python3: ${PYV:-not found}" \
    "($(command -v "$PY"), pip ${PIPV:-none}); $JOBS cores; budget ${BUDGET}s"
missing=()
[[ -n "$PYV" ]] || missing+=("$PY (python3)")
# pip >= 22.3 installs into another interpreter (--python): the venv needs no pip of its own
[[ -n "$PIPV" && "$(printf '22.3\n%s\n' "$PIPV" | sort -V | head -n 1)" == 22.3 ]] ||
    missing+=("pip >= 22.3 for $PY (found: ${PIPV:-none})")
FILES=$(carried_files 2>>"$LOG") || missing+=(".carry/ matching its MANIFEST (python3 build.py carry)")
if [[ "$BACKEND" == cuda ]]; then
    [[ -n "$GPU" ]] || missing+=("an NVIDIA GPU (nvidia-smi finds none)")
    [[ -n "$NVCC" ]] || missing+=("nvcc (CUDA toolkit)")
fi
command -v cmake >/dev/null || "$PY" -c 'import cmake' 2>/dev/null || missing+=("cmake (on PATH or the cmake package)")
# the ggml build's CMAKE_ARGS (for CUDA: where cuBLAS and the driver library are; build.py says what is missing)
if [[ "$BACKEND" == cuda ]]; then
    GGML_ARGS=$("$PY" build.py --cuda --cuda-arch "$ARCH" cmake-args 2>>"$LOG") ||
        missing+=("$(tail -n 1 "$LOG" | sed 's/^build.py: error: //')")
else
    GGML_ARGS=$("$PY" build.py cmake-args 2>>"$LOG")   # CPU + RPC, the defaults
fi
if ((${#missing[@]})); then
    for m in "${missing[@]}"; do say "missing: $m"; done
    step preflight "missing: $(IFS=';'; echo "${missing[*]}")" "$(($(date +%s) - T0))" -
    fail=1
else
    step preflight ok "$(($(date +%s) - T0))" -
fi
WHEELS=() SDIST=""
for f in $FILES; do
    case "$f" in
        *.whl) WHEELS+=("$CARRY/$f") ;;
        *.tar.gz) SDIST="$CARRY/$f" ;;
    esac
done

# ---- venv, wheels ----------------------------------------------------------------------------------------------
make_venv() {
    [[ -f "$VENV/.made" ]] && "$VPY" -c 'import numpy' 2>/dev/null && { echo "reusing $VENV"; return 0; }
    rm -rf "$VENV"
    "$PY" -m venv --system-site-packages --without-pip "$VENV" || return 1
    local site
    site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
    # python3 may itself be a venv (the GPU image's /opt/torch/.venv): add its site-packages after the venv's own
    "$PY" - "$site/_kvcache_parent_site.pth" <<'EOF' || return 1
import site, sys
if sys.prefix != sys.base_prefix:
    with open(sys.argv[1], "w") as f:
        f.write("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in site.getsitepackages()) + "\n")
    print(f"python3 is a venv ({sys.prefix}): its site-packages added through {sys.argv[1]}")
EOF
    "$VPY" -c 'import numpy, scikit_build_core; print("numpy", numpy.__version__, "scikit-build-core",
        scikit_build_core.__version__)' || { echo "the venv lacks numpy or scikit-build-core"; return 1; }
    touch "$VENV/.made"
}
vpip() { "$PY" -m pip --python "$VPY" "$@"; }
export ROOT BACKEND ARCH PY WORK CARRY VENV VPY JOBS
export -f make_venv vpip

if ((fail == 0)); then
    run venv 60 make_venv
fi
if ((fail == 0)); then
    run wheels 60 vpip install --no-index --no-build-isolation --find-links "$CARRY" "${WHEELS[@]}"
fi

# ---- ggml-python ----------------------------------------------------------------------------------------------
build_ggml() {
    local args=$GGML_ARGS src stamp key
    key="$(sha256sum "$SDIST" | cut -c1-64) $args"
    stamp="$WORK/ggml.stamp"   # what the venv's ggml-python was built from
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$key" ]] && "$VPY" -c 'import ggml' 2>/dev/null; then
        echo "ggml-python already built with CMAKE_ARGS=$args"
        return 0
    fi
    # a stable source folder: the build folder's CMake cache stays valid, so a rerun is incremental
    # with build.py's GGML_PATCHES applied, as every other build of this project has them
    src="$WORK/src/$(basename "$SDIST" .tar.gz)"
    if [[ ! -f "$src/.unpacked" ]]; then
        rm -rf "$src" && mkdir -p "$WORK/src" && tar -xzf "$SDIST" -C "$WORK/src" &&
            "$PY" build.py patch-source "$src" >"$src/.unpacked" || return 1
    fi
    echo "patched: $(cat "$src/.unpacked")"
    echo "CMAKE_ARGS=$args"
    CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS GIT_CEILING_DIRECTORIES="$WORK" \
        vpip install --no-index --no-build-isolation --find-links "$CARRY" -v \
        -C "build-dir=$WORK/build-$BACKEND" "$src" >"$WORK/ggml_build.log" 2>&1
    local rc=$?
    grep -E '^\s*\[[0-9]+/[0-9]+\]' "$WORK/ggml_build.log" | tail -n 1 | cut -c1-80
    tail -n 5 "$WORK/ggml_build.log"
    ((rc == 0)) && echo "$key" >"$stamp"
    return $rc
}

export SDIST GGML_ARGS
export -f build_ggml

BUILD_OK=0
if ((fail == 0)); then
    # leave 180 s for the checks after the build (they take about 100 s on a GPU machine)
    run ggml $(($(left) - 180)) build_ggml && BUILD_OK=1
    [[ -f "$WORK/ggml_build.log" ]] && cp "$WORK/ggml_build.log" "$DEST/ggml_build.log"
    [[ -f "$WORK/build-$BACKEND/.ninja_log" ]] && cp "$WORK/build-$BACKEND/.ninja_log" "$DEST/ninja_log.txt"
fi

# ---- the checks -----------------------------------------------------------------------------------------------
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ((BUILD_OK)); then
    run devices 60 "$VPY" -m kvcache_ggml info
    want="device CUDA"
    [[ "$BACKEND" == cuda ]] || want="backends: .*RPC"
    if ! grep -q "$want" "$WORK/out/devices.txt"; then
        say "the build lists no '$want' (see devices in the log)"
        step "devices" "no '$want' listed" 0 -
        BUILD_OK=0
        fail=1
    fi
fi
if ((BUILD_OK)); then
    run parity "$(cap 120 $(($(left) - 100)))" \
        "$VPY" -m kvcache_ggml parity --backends "$BACKEND" --types f16,q8_0,f32 --threads "$JOBS"
    if [[ $(grep -c "^| $BACKEND | .* | PASS |$" "$WORK/out/parity.txt") != 3 ]]; then   # a skip exits 0 too
        say "parity: not three PASS rows for $BACKEND"
        step "parity rows" "not 3 PASS rows for $BACKEND" 0 -
        fail=1
    fi
    run runtime "$(cap 90 $(($(left) - 50)))" \
        "$VPY" -m kvcache_ggml runtime-parity --backend "$BACKEND" --threads "$JOBS" \
        ${GPU_CHECK_RUNTIME_ARGS:---models "tiny f32,llama q8_0" --steps 12}
    # shellcheck disable=SC2086  # the extra arguments are words
    run steps "$(cap 90 $(($(left) - 5)))" \
        "$VPY" -m kvcache_ggml step-times --backends "cpu,$BACKEND" --threads "$JOBS" ${GPU_CHECK_STEP_ARGS:-}
    if (($(left) >= 60)); then
        saved=$fail
        # shellcheck disable=SC2086
        run bench $(($(left) - 10)) "$VPY" -m kvcache_ggml parity --bench --backends "$BACKEND,cpu" --types f16 \
            --threads "$JOBS" --bench-reps 3 ${GPU_CHECK_BENCH_ARGS:-}
        fail=$saved   # the extra step informs; it does not decide pass or fail
    else
        step bench "skipped (extra; under 60 s left)" 0 -
    fi
fi

# ---- results ---------------------------------------------------------------------------------------------------
section() {   # title, file, first line of the part to keep (a regex)
    [[ -s "$2" ]] || return 0
    printf '\n## %s\n\n' "$1"
    sed -n "/$3/,\$p" "$2"
}
{
    echo "# kvcache_ggml GPU check: $([[ $fail == 0 ]] && echo PASS || echo FAIL)"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); backend: $BACKEND; total $(($(date +%s) - T0)) s of a ${BUDGET} s budget"
    echo "- GPU: ${GPU:-none}; nvcc: ${NVCC:-none}; CUDA arch: $ARCH; $JOBS cores; python3 ${PYV:-?}"
    echo "- $(grep -m1 '^ggml ' "$WORK/out/devices.txt" 2>/dev/null || echo 'ggml: not built')"
    grep '^device ' "$WORK/out/devices.txt" 2>/dev/null | sed 's/^/- /'
    echo
    echo "| step | status | time | limit |"
    echo "|---|---|---|---|"
    printf '%s\n' "${STEPS[@]}"
    section "Cache parity ($BACKEND vs CPU)" "$WORK/out/parity.txt" '^| backend'
    section "Runtime parity ($BACKEND vs CPU)" "$WORK/out/runtime.txt" '^runtime parity'
    section "Decode step: host time beside compute time" "$WORK/out/steps.txt" '^step times'
    section "Cache operations on a model-sized cache (extra)" "$WORK/out/bench.txt" '^benchmark:'
} >"$RES"
say "results in $RES (log: $LOG)"
echo
cat "$RES"
exit $fail

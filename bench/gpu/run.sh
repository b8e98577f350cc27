#!/usr/bin/env bash
# The GPU run of issue 42, in one command: ringserve against llama.cpp's llama-server on a GPU.
#
#   bash bench/gpu/run.sh [--cpu] [--dry-run] [--shape 1b|tiny] [--streams "1 8 32 64"]
#                         [--tokens N] [--rounds N] [--threads N] [--flash-attn off|on] [--deadline SECONDS]
#
# Runs from the repository root on a machine with no network, with only what
# bench/gpu/pack.py put in bench/gpu/cargo/ (carried beside the checkout): installs the wheels
# onto a PYTHONPATH (pip --no-index), builds llama.cpp once for this GPU's architecture
# (libllama and llama-server from one build folder), points llama-cpp-python's bindings at that
# libllama (LLAMA_CPP_LIB_PATH), writes a Llama-shaped model with random weights
# (make_model.py), then runs bench/http_streams.py: ringserve, llama-server and the raw loop,
# interleaved rounds, at 1, 8, 32 and 64 streams, with ringserve's engine-idle share.
#
# --cpu rehearses the same stages on a machine without a GPU: the CPU backend, the tiny shape,
# 1 and 4 streams, 1 thread. --dry-run prints the stages and commands and runs nothing.
# --flash-attn (default off, ringserve's default) is both servers' flash attention; off, the CUDA
# build leaves out its kernels (GGML_CUDA_FA=OFF: a third less to compile, bench/gpu/README.md).
#
# Each stage runs under `timeout` with its budget (seconds; the build's fits a 16-core machine,
# bench/gpu/README.md says how it was measured), logs to $OUT/run.log and appends its time to
# $OUT/stages.tsv; a stage that fails ends the run with one line naming it. Whatever is done is
# kept in bench/gpu/work/ (git-ignored): run the same command again and the build, the
# installed wheels and the model are reused. The benchmark gets what is left of --deadline
# (default 570 s on a GPU: the machine's 10 minutes per command); with under 90 s left it is
# skipped, saying so.
#
# Results in $OUT (default bench/gpu/work/out): run.log, stages.tsv, http_streams.json and .png,
# ringserve.log, llama-server.log, gpu_run.md (the tables for docs/benchmarks.md).
#
# Environment: PYTHON (default python3, which must have numpy: PyTorch's has), CARGO (default
# bench/gpu/cargo), WORK (default bench/gpu/work), JOBS (compile jobs, default nproc),
# CUDA_ARCH (default: nvidia-smi's compute capability, 9.0 -> 90), BUILD_BUDGET (the build's
# seconds: 360 on a GPU, 3600 with --cpu; more to rehearse the CUDA compile on a small machine).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
START=$(date +%s)

usage() { echo "usage: bash bench/gpu/run.sh [--cpu] [--dry-run] [--shape 1b|tiny] [--streams \"N ...\"] [--tokens N] [--rounds N] [--threads N] [--flash-attn off|on] [--deadline S]" >&2; exit 2; }
die() { echo "run.sh: $*" >&2; exit 2; }

CPU=0 DRY=0 SHAPE="" STREAMS="" TOKENS="" ROUNDS="" THREADS="" DEADLINE="" FA=off
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) CPU=1 ;;
        --dry-run) DRY=1 ;;
        --shape) SHAPE=${2-}; shift ;;
        --streams) STREAMS=${2-}; shift ;;
        --tokens) TOKENS=${2-}; shift ;;
        --rounds) ROUNDS=${2-}; shift ;;
        --threads) THREADS=${2-}; shift ;;
        --flash-attn) FA=${2-}; shift ;;
        --deadline) DEADLINE=${2-}; shift ;;
        -h|--help) usage ;;
        *) die "unknown argument: $1 (--help)" ;;
    esac
    shift
done

if [ "$CPU" = 1 ]; then
    MODE=cpu; : "${SHAPE:=tiny}" "${STREAMS:=1 4}" "${TOKENS:=32}" "${ROUNDS:=1}" "${THREADS:=1}" "${DEADLINE:=0}"
else
    MODE=cuda; : "${SHAPE:=1b}" "${STREAMS:=1 8 32 64}" "${TOKENS:=256}" "${ROUNDS:=3}" "${THREADS:=4}" "${DEADLINE:=570}"
fi
case "$SHAPE" in 1b|tiny) ;; *) die "--shape must be 1b or tiny, not '$SHAPE'" ;; esac
case "$FA" in on|off) ;; *) die "--flash-attn must be on or off, not '$FA'" ;; esac
for n in $STREAMS $TOKENS $ROUNDS $THREADS; do
    case "$n" in ''|*[!0-9]*|0) die "--streams, --tokens, --rounds and --threads take positive integers, not '$n'" ;; esac
done
case "$DEADLINE" in ''|*[!0-9]*) die "--deadline takes seconds (0: none), not '$DEADLINE'" ;; esac
[ -n "$STREAMS" ] || die "--streams needs at least one count"
SLOTS=$(printf '%s\n' $STREAMS | sort -n | tail -1)

PYTHON=${PYTHON:-python3}
CARGO=$(realpath -m "${CARGO:-bench/gpu/cargo}")
WORK=$(realpath -m "${WORK:-bench/gpu/work}")
OUT=$(realpath -m "${OUT:-$WORK/out}")
JOBS=${JOBS:-$(nproc)}
SITE=$WORK/site
SRC=$WORK/llama.cpp
BUILD=$WORK/build-$MODE
MODEL=$WORK/model-$SHAPE.gguf
export PYTHONPATH="$SITE:$CARGO/python:$ROOT" LLAMA_CPP_LIB_PATH="$BUILD/bin" PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH="$WORK/cublas/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1

# stage budgets (seconds)
declare -A BUDGET=([preflight]=30 [python]=120 [source]=60 [configure]=120 [build]=360 [bindings]=60
                   [model]=120 [bench]=0 [report]=30)
[ "$MODE" = cpu ] && BUDGET[build]=3600
BUDGET[build]=${BUILD_BUDGET:-${BUDGET[build]}}
BENCH_MIN=90

CMAKE_FLAGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_CCACHE=OFF -DLLAMA_CURL=OFF
             -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF
             -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF)
if [ "$MODE" = cuda ]; then
    if [ -z "${CUDA_ARCH:-}" ] && command -v nvidia-smi >/dev/null; then
        CUDA_ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
    fi
    CMAKE_FLAGS+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-<nvidia-smi compute_cap>}-real"
                  "-DGGML_CUDA_FA=$([ "$FA" = on ] && echo ON || echo OFF)")
fi
BENCH_ARGS=(bench/http_streams.py --model "$MODEL" --llama-server "$BUILD/bin/llama-server"
            --servers ringserve llama-server --streams $STREAMS --slots "$SLOTS" --tokens "$TOKENS"
            --rounds "$ROUNDS" --threads "$THREADS" --flash-attn "$FA" --logs "$OUT")

if [ "$DRY" = 1 ]; then
    echo "mode $MODE: shape $SHAPE, streams $STREAMS (slots $SLOTS), $TOKENS tokens, $ROUNDS rounds, $THREADS threads, flash attention $FA, deadline ${DEADLINE}s"
    echo "stage preflight (${BUDGET[preflight]}s): $PYTHON >= 3.11 with numpy, cmake, ninja$([ "$MODE" = cuda ] && echo ", nvcc, nvidia-smi"), $CARGO/MANIFEST.json"
    echo "stage python (${BUDGET[python]}s): $PYTHON -m pip install --no-index --no-deps --find-links $CARGO/wheels --target $SITE -r $CARGO/wheels/requirements.txt"
    echo "stage source (${BUDGET[source]}s): tar xJf $CARGO/llama.cpp.tar.xz -C $WORK"
    echo "stage configure (${BUDGET[configure]}s): cmake -S $SRC -B $BUILD ${CMAKE_FLAGS[*]}$([ "$MODE" = cuda ] && echo " (cuBLAS from $PYTHON's nvidia-cublas when the toolkit has none; the driver the loader knows, else -DGGML_CUDA_NO_VMM=ON)")"
    echo "stage build (${BUDGET[build]}s): cmake --build $BUILD -j $JOBS --target llama llama-server"
    echo "stage bindings (${BUDGET[bindings]}s): LLAMA_CPP_LIB_PATH=$BUILD/bin $PYTHON -c 'import llama_cpp, ringserve.server'"
    echo "stage model (${BUDGET[model]}s): $PYTHON bench/gpu/make_model.py --vocab $CARGO/vocab.gguf --shape $SHAPE --out $MODEL"
    echo "stage bench (what is left of ${DEADLINE}s, at least ${BENCH_MIN}s): RINGSERVE_BENCH_RESULTS=$OUT $PYTHON ${BENCH_ARGS[*]}$([ "$DEADLINE" -gt 0 ] && echo " --deadline <what is left - 30>")"
    echo "stage report (${BUDGET[report]}s): $PYTHON bench/gpu/report.py $OUT > $OUT/gpu_run.md"
    exit 0
fi

mkdir -p "$OUT" "$WORK" || die "cannot create $OUT and $WORK"
LOG=$OUT/run.log
STAGES=$OUT/stages.tsv
: > "$LOG"
printf 'stage\tstatus\tseconds\tbudget\n' > "$STAGES"
echo "run.sh $MODE: shape $SHAPE, streams $STREAMS, $TOKENS tokens, $ROUNDS rounds, $THREADS threads, flash attention $FA; log $LOG"

# stage NAME BUDGET COMMAND...: run COMMAND under timeout, its output appended to the log; time it;
# on failure print one line and exit 1.
stage() {
    local name=$1 budget=$2 t0 rc took last
    shift 2
    t0=$(date +%s)
    echo "=== $name (budget ${budget}s) $(date -u +%H:%M:%S)" >> "$LOG"
    timeout --kill-after=10 "$budget" bash -c '"$@"' "$name" "$@" >> "$LOG" 2>&1
    rc=$?
    took=$(( $(date +%s) - t0 ))
    if [ $rc -eq 0 ]; then
        printf '%s\tok\t%s\t%s\n' "$name" "$took" "$budget" >> "$STAGES"
        echo "  $name: ${took}s (budget ${budget}s)"
        return 0
    fi
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        printf '%s\ttimeout\t%s\t%s\n' "$name" "$took" "$budget" >> "$STAGES"
        echo "run.sh: stage $name ran past its ${budget}s budget (see $LOG); run the same command again to go on from there" >&2
    else
        printf '%s\tfailed\t%s\t%s\n' "$name" "$took" "$budget" >> "$STAGES"
        last=$(grep -v '^\s*$' "$LOG" | tail -1 | cut -c1-300)
        echo "run.sh: stage $name failed (exit $rc after ${took}s): $last (see $LOG)" >&2
    fi
    exit 1
}

preflight() {
    [ -f "$CARGO/MANIFEST.json" ] || { echo "no $CARGO/MANIFEST.json: run bench/gpu/pack.py where PyPI is reachable and carry bench/gpu/cargo"; return 1; }
    "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), f"Python {sys.version.split()[0]}: ringserve needs 3.11 or later"; import numpy; print(sys.executable, sys.version.split()[0], "numpy", numpy.__version__)' || return 1
    for tool in cmake ninja timeout tar; do command -v $tool >/dev/null || { echo "$tool is not on PATH"; return 1; }; done
    cmake --version | head -1
    if [ "$MODE" = cuda ]; then
        command -v nvcc >/dev/null || { echo "nvcc is not on PATH"; return 1; }
        command -v nvidia-smi >/dev/null || { echo "nvidia-smi is not on PATH"; return 1; }
        nvcc --version | tail -2
        nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
        [ -n "${CUDA_ARCH:-}" ] || { echo "nvidia-smi gave no compute capability"; return 1; }
    fi
    echo "$(nproc) cores, $(free -g | awk '/^Mem/ {print $2}') GiB memory, $(df -h "$WORK" | awk 'NR==2 {print $4}') free in $WORK"
}

install_wheels() {
    local stamp=$SITE/.requirements
    if cmp -s "$CARGO/wheels/requirements.txt" "$stamp"; then echo "already installed in $SITE"; return 0; fi
    rm -rf "$SITE"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --find-links "$CARGO/wheels" --target "$SITE" \
        -r "$CARGO/wheels/requirements.txt" || return 1
    cp "$CARGO/wheels/requirements.txt" "$stamp"
}

unpack_source() {
    local stamp=$WORK/llama.cpp.sha256 sum
    sum=$(sha256sum "$CARGO/llama.cpp.tar.xz" | cut -d' ' -f1)
    if [ -d "$SRC" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$sum" ]; then echo "already unpacked in $SRC"; return 0; fi
    rm -rf "$SRC" "$BUILD"
    tar xJf "$CARGO/llama.cpp.tar.xz" -C "$WORK" || return 1
    echo "$sum" > "$stamp"
    echo "$(find "$SRC" -type f | wc -l) files in $SRC"
}

check_bindings() {
    "$PYTHON" - "$MODE" <<'EOF'
import sys
import llama_cpp
import ringserve.server  # every runtime dependency resolves
lc = llama_cpp.llama_cpp
print("llama-cpp-python", llama_cpp.__version__, "from", llama_cpp.__file__, "library", lc._base_path)
print(lc.llama_print_system_info().decode())
gpu = lc.llama_supports_gpu_offload()
print("GPU offload:", gpu)
assert gpu or sys.argv[1] == "cpu", "llama.cpp has no GPU to offload to (no CUDA backend, or no device: see ggml_cuda_init above)"
EOF
}

# CMake flags for what FindCUDAToolkit may not find on a machine whose toolkit is NVIDIA's pip wheels
# (this workplace's: nvcc and the runtime, no cuBLAS, no driver stub):
# - cuBLAS: the toolkit's own, else the nvidia-cublas wheel in $PYTHON's site-packages (PyTorch's),
#   through a folder of links to its headers and libraries only (the wheel's include/ holds other
#   CUDA headers than the toolkit's);
# - the driver (libcuda, which ggml links for its virtual-memory pool): the one the loader knows or
#   one in LD_LIBRARY_PATH or the usual folders, else none and GGML_CUDA_NO_VMM (cudaMalloc'd
#   pools; a build on a machine without a GPU, as in a rehearsal).
cuda_flags() {
    local header inc lib driver shim=$WORK/cublas
    if ! echo '#include <cublas_v2.h>' | nvcc -E -x cu - -o /dev/null 2>/dev/null; then
        header=$("$PYTHON" -c 'import glob, site; h = sorted(h for d in site.getsitepackages() for h in glob.glob(d + "/nvidia/*/include/cublas_v2.h")); print(h[0] if h else "")')
        [ -n "$header" ] || { echo "no cuBLAS: neither nvcc's toolkit nor $PYTHON's site-packages (nvidia-cublas) has cublas_v2.h" >&2; return 1; }
        inc=$(dirname "$header"); lib=$(dirname "$inc")/lib
        rm -rf "$shim"; mkdir -p "$shim/include" "$shim/lib"
        ln -s "$inc"/cublas*.h "$shim/include/"
        for so in "$lib"/libcublas.so.* "$lib"/libcublasLt.so.*; do
            ln -sf "$so" "$shim/lib/"  # the name it is loaded by (libcublas.so.13)
            ln -sf "$so" "$shim/lib/$(basename "$so" | sed 's/\.so\..*/.so/')"  # the name the linker looks for
        done
        echo "-DCUDA_cublas_LIBRARY=$shim/lib/libcublas.so -DCUDA_cublasLt_LIBRARY=$shim/lib/libcublasLt.so -DCMAKE_CUDA_FLAGS=-I$shim/include"
    fi
    driver=$(ldconfig -p 2>/dev/null | awk '$1 ~ /^libcuda\.so/ {print $NF; exit}')
    for d in ${LD_LIBRARY_PATH//:/ } /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu /usr/lib64; do
        [ -z "$driver" ] || break
        for f in "$d/libcuda.so" "$d/libcuda.so.1"; do [ -e "$f" ] && { driver=$f; break; }; done
    done
    if [ -n "$driver" ]; then echo "-DCUDA_cuda_driver_LIBRARY=$driver"; else echo "-DGGML_CUDA_NO_VMM=ON"; fi
}

configure() {
    local extra=""
    if [ "$MODE" = cuda ]; then extra=$(cuda_flags) || return 1; fi
    [ -z "$extra" ] || echo "CUDA paths:" $extra
    # shellcheck disable=SC2086 # the flags are words without spaces, one a line
    cmake -S "$SRC" -B "$BUILD" "$@" $extra
}

make_model() {
    [ -s "$MODEL" ] && { echo "already made: $MODEL"; return 0; }
    "$PYTHON" bench/gpu/make_model.py --vocab "$CARGO/vocab.gguf" --shape "$SHAPE" --out "$MODEL.part" || return 1
    mv "$MODEL.part" "$MODEL"
}

# the stages run in a child bash under timeout (which ends the whole process group on time-out)
export -f preflight install_wheels unpack_source cuda_flags configure check_bindings make_model
export MODE SHAPE PYTHON CARGO WORK SITE SRC BUILD MODEL OUT CUDA_ARCH="${CUDA_ARCH:-}"

stage preflight "${BUDGET[preflight]}" preflight
stage python "${BUDGET[python]}" install_wheels
stage source "${BUDGET[source]}" unpack_source
stage configure "${BUDGET[configure]}" configure "${CMAKE_FLAGS[@]}"
stage build "${BUDGET[build]}" cmake --build "$BUILD" -j "$JOBS" --target llama llama-server
stage bindings "${BUDGET[bindings]}" check_bindings
stage model "${BUDGET[model]}" make_model

left=$(( DEADLINE > 0 ? DEADLINE - ($(date +%s) - START) - BUDGET[report] : 86400 ))
if [ "$left" -lt "$BENCH_MIN" ]; then
    printf 'bench\tskipped\t0\t%s\n' "$left" >> "$STAGES"
    echo "run.sh: ${left}s left of the ${DEADLINE}s deadline, under the benchmark's ${BENCH_MIN}s: run the same command again (the build and the model are kept)" >&2
    exit 1
fi
# rounds stop early when another would not end 30 s before the stage's time-out (servers stopped, files written)
[ "$DEADLINE" -gt 0 ] && BENCH_ARGS+=(--deadline "$(( left - 30 ))")
stage bench "$left" env RINGSERVE_BENCH_RESULTS="$OUT" "$PYTHON" "${BENCH_ARGS[@]}"
stage report "${BUDGET[report]}" sh -c '"$PYTHON" bench/gpu/report.py "$OUT" > "$OUT/gpu_run.md"'
echo "done in $(( $(date +%s) - START ))s: $OUT/gpu_run.md"

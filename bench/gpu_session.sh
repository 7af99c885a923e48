#!/usr/bin/env bash
# One GPU session's checks and benchmarks, in one command, with every result written as files.
#
#   bench/gpu_session.sh [tests] [quick] [bench ARGS...]
#
# Steps (each one named on the command line runs, in this order; default: tests quick):
#   tests   the CUDA library tests with ATTNC_GPU_TESTS=1: every example and every op on the
#           device against the interpreter, the f16/bf16 flash kernels, the compile cache
#   ptxas   the flash kernels' registers, spills and shared memory (nvcc --resource-usage on the
#           emitted CUDA of the benchmark programs, D=128 and D=64)
#   rows    the tensor-core kernel with 64 and 128 query rows per block (ATTNC_CUDA_MMA_ROWS),
#           attnc alone on f16 cases, interleaved, into rows.txt
#   versus PATH
#           another attnc binary (e.g. the previous commit's) against this one, the same way,
#           into versus.txt
#   ncu     Nsight Compute on the f16 flash kernel (B=4, H=16, S=4096, D=128, no mask):
#           throughput, occupancy, warp stalls, into ncu.txt
#   wgmma   Hopper's warpgroup products: the device's flash tests, forward and backward, at head
#           widths 64 and 128 (the widths that take wgmma on sm_90a), then attnc alone on f16
#           cases with the forward on wgmma (sm_90a, the default on an sm_90 device: tma, the
#           warp-specialised block: a producer warpgroup loading a ring of K/V stages by TMA and
#           two consumers), its producer copying with cp.async instead (ws: ATTNC_CUDA_TMA=0),
#           in one warpgroup (wg: ATTNC_CUDA_WS=0, its two m-tiles pipelined, two K/V stages)
#           and on mma.sync (ATTNC_CUDA_WGMMA=0: plain sm_90), and training steps (--grad) with the
#           backward on wgmma and on mma.sync (-DATTNC_NO_WGMMA_BWD through
#           ATTNC_NVRTC_OPTIONS; the forward on wgmma in both), and ALiBi training with its
#           slopes' gradient on the tensor-core backward against SIMT (ATTNC_CUDA_BWD=simt),
#           interleaved over two rounds, into wgmma.txt
#   python  attnc's Python package on the device: the wheel in $ATTNC_BIN_DIR (built on any x86-64
#           machine: maturin build --release -m python/Cargo.toml -o DIR; abi3, so any Python
#           3.9+) installed into a scratch directory, then python/tests/test_cuda_tensors.py
#           (CUDA tensors from torch by device pointer, sdpa forward and gradients), into
#           python.log
#   bwd     the tensor-core flash backward against the SIMT one (ATTNC_CUDA_BWD=simt), attnc bench
#           --grad alone, f16, interleaved, into bwd.txt
#   train   bench/compare_gpu.py --train: attnc --grad (the flash backward) against an SDPA
#           training step, f16, none and causal, S=1024 and 4096, into train.md
#   train-det
#           the same at S=4096 with the tensor-core backward's deterministic mode
#           (ATTNC_CUDA_BWD=deterministic: no atomic adds), into train-det.md
#   additive
#           bench/bahdanau.py --target cuda: additive attention against PyTorch eager, with inputs
#           in the product form's range (trained) and outside it (wide), into additive.txt
#   serving the serving forms on the device: the flash backward's and every example's device
#           tests (sinks through the log-sum-exp's cotangent, varlen, varlen_kv, lse_merge), then
#           a packed ragged batch (8 sequences of 100–4000 tokens, f32, H=8, D=64) against the
#           batch padded to 4000 and the sequences one by one (bench/varlen.sh's comparison),
#           into serving.txt
#   quick   bench/compare_gpu.py --quick --check
#   bench   bench/compare_gpu.py with the remaining arguments (e.g. the full table)
#
# Binaries: $ATTNC_BIN_DIR/attnc and $ATTNC_BIN_DIR/cuda-tests (default target/release/attnc
# and the newest release unit-test binary of attn-cuda), so that they can be built on another
# machine and carried. Results go to $OUT (default out/gpu): env.txt, tests.log, quick.md, ...
# NVRTC: ATTNC_NVRTC_LIB if set, else the first libnvrtc.so.1x found in the CUDA toolkit or in
# PyTorch's nvidia packages.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
BIN=${ATTNC_BIN_DIR:-target/release}
ATTNC="$BIN/attnc"
TESTS="$BIN/cuda-tests"
if [ ! -x "$TESTS" ]; then
    TESTS=$(ls -t target/release/deps/attn_cuda-* 2>/dev/null | grep -v '\.d$' | head -1)
fi

if [ -z "${ATTNC_NVRTC_LIB:-}" ]; then
    lib=$( (ls /usr/local/cuda/lib64/libnvrtc.so.1? 2>/dev/null; find / -xdev -name 'libnvrtc.so.1?' 2>/dev/null) | head -1)
    if [ -n "$lib" ]; then
        # cudarc opens NVRTC by its usual names (libnvrtc.so, libnvrtc.so.12, ...): give the
        # found one the plain name on the loader's path, whatever its major version.
        mkdir -p /tmp/attnc-nvrtc
        ln -sf "$lib" /tmp/attnc-nvrtc/libnvrtc.so
        export ATTNC_NVRTC_LIB="$lib"
        export LD_LIBRARY_PATH="/tmp/attnc-nvrtc:$(dirname "$lib"):${LD_LIBRARY_PATH:-}"
    fi
fi
export ATTNC_EXAMPLES_DIR="$PWD/examples"

# program KIND DEST: compare_gpu.py's f16 benchmark program for a mask kind, written to DEST.
program() {
    python3 -c "import sys; sys.path.insert(0, 'bench'); import compare_gpu as c; print(c.program_text('f16', sys.argv[1]))" "$1" > "$2"
}

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    nvcc --version 2>/dev/null | tail -2
    echo "NVRTC: ${ATTNC_NVRTC_LIB:-not found}"
    python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' 2>&1
    "$ATTNC" --version
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests ptxas quick)
i=0
while [ $i -lt ${#steps[@]} ]; do
    step=${steps[$i]}
    i=$((i + 1))
    case "$step" in
    tests)
        echo "== tests"
        ATTNC_GPU_TESTS=1 timeout 400 "$TESTS" gpu_tests --test-threads 4 --nocapture > "$OUT/tests.log" 2>&1
        echo "tests: exit $?"
        grep -E "^test |test result|failure|error" "$OUT/tests.log" | grep -v " ok$" | head -40
        ;;
    ptxas)
        echo "== ptxas"
        for kind in none alibi; do
            program "$kind" "$OUT/$kind.attn"
            "$ATTNC" build "$OUT/$kind.attn" --emit cuda > "$OUT/$kind.cu"
            for hd in 64 128; do
                echo "-- $kind HD=$hd"
                nvcc -arch=sm_90 -cubin -o /dev/null --resource-usage -DATTNC_HD_0=$hd -DATTNC_BN_0=64 "$OUT/$kind.cu" 2>&1 | grep -E "Function properties|registers|spill|error" | head -8
            done
        done > "$OUT/ptxas.txt" 2>&1
        cat "$OUT/ptxas.txt"
        ;;
    ncu)
        echo "== ncu"
        program none /tmp/attnc-ncu.attn
        timeout 300 ncu --target-processes all -k regex:attnc_s0_flash --launch-count 1 \
            --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
            --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
            "$ATTNC" bench /tmp/attnc-ncu.attn --target cuda --dim B=4 --dim H=16 --dim S=4096 --dim D=128 \
            --iters 1 --warmup 0 > "$OUT/ncu.txt" 2>&1
        echo "ncu: exit $?"
        grep -E "Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Block Limit|Stall|Issued Ipc|No Eligible|Warp Cycles" "$OUT/ncu.txt" | head -40
        ;;
    wgmma)
        echo "== wgmma"
        ATTNC_GPU_TESTS=1 ATTNC_GPU_WIDTHS=64,128 timeout 240 "$TESTS" gpu_tests::flash_kernels gpu_tests::flash_backward gpu_tests::device_tensors \
            --test-threads 2 --nocapture > "$OUT/tests-wgmma.log" 2>&1
        rc=$?
        echo "wgmma tests: exit $rc"
        grep -E "^device|test result|panicked|FAIL|failure" "$OUT/tests-wgmma.log" | head -20
        if [ "$rc" != 0 ]; then
            # Which newer part of the Hopper forward fails: the forward tests again with the
            # cp.async producer waiting for its copies, then also without TMA, then in one
            # warpgroup, then with one K/V stage, then also without the pipelined tile; the rest
            # of the session uses the first that passes.
            for fallback in "ATTNC_NVRTC_OPTIONS=-DATTNC_WS_CP_WAIT" "ATTNC_CUDA_TMA=0 ATTNC_NVRTC_OPTIONS=-DATTNC_WS_CP_WAIT" \
                "ATTNC_CUDA_WS=0" "ATTNC_CUDA_WS=0 ATTNC_CUDA_KV_STAGES=1" \
                "ATTNC_CUDA_WS=0 ATTNC_CUDA_KV_STAGES=1 ATTNC_NVRTC_OPTIONS=-DATTNC_WG_SYNC"; do
                env $fallback ATTNC_GPU_TESTS=1 ATTNC_GPU_WIDTHS=64,128 timeout 120 "$TESTS" gpu_tests::flash_kernels \
                    --test-threads 2 --nocapture > "$OUT/tests-fallback.log" 2>&1
                rc_fb=$?
                echo "wgmma forward tests with $fallback: exit $rc_fb"
                if [ "$rc_fb" = 0 ]; then
                    export $fallback
                    echo "the rest of this session runs with $fallback"
                    break
                fi
            done
        fi
        for kind in none causal alibi softcap; do
            program "$kind" "/tmp/attnc-wg-$kind.attn"
        done
        for round in 1 2; do
            for spec in "none 128 4096" "causal 128 4096" "none 64 4096" "causal 64 4096" "alibi 128 4096" "softcap 128 4096" "none 128 16384" "causal 128 1024"; do
                set -- $spec
                for mode in tma ws wg mma; do
                    knob=1 opts="${ATTNC_NVRTC_OPTIONS:-}" stages="${ATTNC_CUDA_KV_STAGES:-}" ws="${ATTNC_CUDA_WS:-}" tma="${ATTNC_CUDA_TMA:-}"
                    [ "$mode" = mma ] && knob=0
                    [ "$mode" = ws ] && tma=0
                    [ "$mode" = wg ] && ws=0
                    ms=$(ATTNC_CUDA_TMA=$tma ATTNC_CUDA_WS=$ws ATTNC_CUDA_KV_STAGES=$stages ATTNC_NVRTC_OPTIONS=$opts ATTNC_CUDA_WGMMA=$knob timeout 60 "$ATTNC" bench "/tmp/attnc-wg-$1.attn" --target cuda --json --iters 20 --warmup 3 \
                        --dim B=4 --dim H=16 --dim S=$3 --dim D=$2 | sed -n 's/^json: .*"median_ms": *\([0-9.e+-]*\).*/\1/p')
                    tf=$(awk -v ms="$ms" -v s=$3 -v d=$2 -v c=$1 'BEGIN { if (ms > 0) { f = 4 * 4 * 16 * s * s * d; if (c != "none") f /= 2; printf "%.0f", f / (ms * 1e9) } }')
                    echo "round $round $1 D=$2 S=$3 $mode: $ms ms ($tf TFLOP/s)"
                done
            done
            for spec in "causal 128 4096" "none 128 4096" "causal 64 4096" "causal 128 1024"; do
                set -- $spec
                for mode in wgmma mma; do
                    opts="${ATTNC_NVRTC_OPTIONS:-}"
                    [ "$mode" = mma ] && opts="$opts -DATTNC_NO_WGMMA_BWD"
                    ms=$(ATTNC_NVRTC_OPTIONS=$opts timeout 60 "$ATTNC" bench "/tmp/attnc-wg-$1.attn" --target cuda --grad --json --iters 10 --warmup 2 \
                        --dim B=4 --dim H=16 --dim S=$3 --dim D=$2 | sed -n 's/^json: .*"median_ms": *\([0-9.e+-]*\).*/\1/p')
                    echo "round $round training $1 D=$2 S=$3 backward on $mode: $ms ms"
                done
            done
            # ALiBi with its slopes' gradient: the tensor-core backward against the SIMT one.
            for mode in tc simt; do
                knob=""
                [ "$mode" = simt ] && knob=simt
                ms=$(ATTNC_CUDA_BWD=$knob timeout 120 "$ATTNC" bench /tmp/attnc-wg-alibi.attn --target cuda --grad --json --iters 5 --warmup 1 \
                    --dim B=4 --dim H=16 --dim S=1024 --dim D=128 | sed -n 's/^json: .*"median_ms": *\([0-9.e+-]*\).*/\1/p')
                echo "round $round training alibi (slopes too) D=128 S=1024 backward on $mode: $ms ms"
            done
        done > "$OUT/wgmma.txt" 2>&1
        cat "$OUT/wgmma.txt"
        ;;
    python)
        echo "== python"
        whl=$(ls "$BIN"/attnc-*.whl 2>/dev/null | head -1)
        if [ -z "$whl" ]; then
            echo "python: no attnc wheel in $BIN"
        else
            python3 -m pip install -q --no-deps --no-index --target /tmp/attnc-site "$whl" > "$OUT/python.log" 2>&1
            PYTHONPATH=/tmp/attnc-site timeout 240 python3 -m pytest -q -p no:cacheprovider python/tests/test_cuda_tensors.py >> "$OUT/python.log" 2>&1
            echo "python: exit $?"
            tail -15 "$OUT/python.log"
        fi
        ;;
    rows | versus)
        # rows: the tensor-core kernel's query rows per block (ATTNC_CUDA_MMA_ROWS: 64 = one
        # m-tile per warp, 128 = two). versus PATH: another attnc binary (e.g. the previous
        # commit's) against this one. attnc alone, f16, interleaved over two rounds.
        if [ "$step" = versus ]; then
            other=${steps[$i]:?versus needs the other attnc binary}
            i=$((i + 1))
            variants=("other|$other|" "this|$ATTNC|")
        else
            variants=("rows=64|$ATTNC|64" "rows=128|$ATTNC|128")
        fi
        echo "== $step"
        for kind in none causal alibi softcap; do
            program "$kind" "$OUT/ab-$kind.attn"
        done
        for round in 1 2; do
            for spec in "none 128 4096" "causal 128 4096" "alibi 128 4096" "softcap 128 4096" "none 64 4096" "none 128 16384" "causal 128 1024"; do
                set -- $spec
                for v in "${variants[@]}"; do
                    IFS='|' read -r label bin rows <<< "$v"
                    ms=$(ATTNC_CUDA_MMA_ROWS=$rows timeout 60 "$bin" bench "$OUT/ab-$1.attn" --target cuda --json --iters 20 --warmup 3 \
                        --dim B=4 --dim H=16 --dim S=$3 --dim D=$2 | sed -n 's/^json: .*"median_ms": *\([0-9.e+-]*\).*/\1/p')
                    echo "round $round $1 D=$2 S=$3 $label: $ms ms"
                done
            done
        done > "$OUT/$step.txt" 2>&1
        cat "$OUT/$step.txt"
        ;;
    bwd)
        # The tensor-core flash backward against the SIMT one (ATTNC_CUDA_BWD=simt): attnc bench
        # --grad, f16, interleaved over two rounds.
        echo "== bwd"
        for kind in none causal; do
            program "$kind" "$OUT/bwd-$kind.attn"
        done
        for round in 1 2; do
            for spec in "none 64 1024" "none 128 1024" "causal 128 1024" "none 128 4096"; do
                set -- $spec
                for mode in tc simt; do
                    knob=""
                    [ "$mode" = simt ] && knob=simt
                    ms=$(ATTNC_CUDA_BWD=$knob timeout 120 "$ATTNC" bench "$OUT/bwd-$1.attn" --target cuda --grad --json --iters 5 --warmup 1 \
                        --dim B=4 --dim H=16 --dim S=$3 --dim D=$2 | sed -n 's/^json: .*"median_ms": *\([0-9.e+-]*\).*/\1/p')
                    echo "round $round $1 D=$2 S=$3 $mode: $ms ms"
                done
            done
        done > "$OUT/bwd.txt" 2>&1
        cat "$OUT/bwd.txt"
        ;;
    train)
        echo "== train"
        PYTHONUNBUFFERED=1 timeout 400 python3 bench/compare_gpu.py --attnc "$ATTNC" --train --cases none,causal \
            --dtypes f16 --seqs 1024,4096 --iters 10 --warmup 2 --out "$OUT/train.md" 2> "$OUT/train.log"
        echo "train: exit $?"
        tail -8 "$OUT/train.log"
        ;;
    train-det)
        echo "== train-det"
        ATTNC_CUDA_BWD=deterministic PYTHONUNBUFFERED=1 timeout 200 python3 bench/compare_gpu.py --attnc "$ATTNC" --train \
            --cases none,causal --dtypes f16 --seqs 4096 --iters 10 --warmup 2 --out "$OUT/train-det.md" 2> "$OUT/train-det.log"
        echo "train-det: exit $?"
        tail -4 "$OUT/train-det.log"
        ;;
    additive)
        echo "== additive"
        PYTHONUNBUFFERED=1 timeout 200 python3 bench/bahdanau.py --target cuda --attnc "$ATTNC" --sizes 1024,2048 \
            --rounds 2 --iters 10 > "$OUT/additive.txt" 2>&1
        echo "additive: exit $?"
        cat "$OUT/additive.txt"
        ;;
    serving)
        echo "== serving"
        ATTNC_GPU_TESTS=1 timeout 200 "$TESTS" gpu_tests::flash_backward gpu_tests::every_example gpu_tests::flash_kernels \
            --test-threads 2 --nocapture > "$OUT/tests-serving.log" 2>&1
        echo "serving tests: exit $?"
        grep -E "sinks|varlen|lse_merge|paged|test result|panicked|FAIL" "$OUT/tests-serving.log" | head -30
        python3 bench/write_ids.py "$OUT/seq.npy" 100 650 1200 1750 2300 2850 3400 4000
        ms() { timeout 60 "$ATTNC" bench "$@" --target cuda --iters 10 --warmup 2 --json | sed -n 's/^json: .*"median_ms": *\([0-9.e+-]*\).*/\1/p'; }
        for round in 1 2; do
            p=$(ms examples/varlen.attn --input "seq=$OUT/seq.npy" --dim H=8 --dim D=64)
            q=$(ms examples/causal.attn --dim B=8 --dim H=8 --dim S=4000 --dim D=64)
            s=0
            for n in 100 650 1200 1750 2300 2850 3400 4000; do
                t=$(ms examples/causal.attn --dim B=1 --dim H=8 --dim S=$n --dim D=64)
                s=$(awk -v a="$s" -v b="$t" 'BEGIN {print a + b}')
            done
            echo "round $round: packed $p ms, padded to 4000 $q ms, one by one $s ms"
        done > "$OUT/serving.txt" 2>&1
        cat "$OUT/serving.txt"
        # Paged decode (pages of 16, shuffled, read in place) against the contiguous decode.
        python3 bench/write_pages.py "$OUT/table.npy" "$OUT/lens.npy" 1 32768 16
        for round in 1 2; do
            p=$(ms examples/paged_decode.attn --input "block_table=$OUT/table.npy" --input "lens=$OUT/lens.npy" \
                --dim H=32 --dim D=128 --dim M=1 --dim P=16 --dim NP=2048)
            c=$(ms examples/decode.attn --dim B=1 --dim H=32 --dim T=32768 --dim D=128)
            echo "round $round: paged decode $p ms, contiguous decode $c ms"
        done >> "$OUT/serving.txt" 2>&1
        tail -2 "$OUT/serving.txt"
        rm -f "$OUT/seq.npy" "$OUT/table.npy" "$OUT/lens.npy"
        ;;
    quick)
        echo "== quick"
        PYTHONUNBUFFERED=1 timeout 400 python3 bench/compare_gpu.py --attnc "$ATTNC" --quick --check \
            --cases none,causal,alibi,softcap --out "$OUT/quick.md" 2> "$OUT/quick.log"
        echo "quick: exit $?"
        tail -5 "$OUT/quick.log"
        ;;
    bench)
        echo "== bench ${steps[*]:$i}"
        PYTHONUNBUFFERED=1 python3 bench/compare_gpu.py --attnc "$ATTNC" "${steps[@]:$i}" --out "$OUT/bench.md" 2> "$OUT/bench.log"
        echo "bench: exit $?"
        tail -5 "$OUT/bench.log"
        i=${#steps[@]}
        ;;
    *)
        echo "unknown step $step" >&2
        exit 2
        ;;
    esac
done

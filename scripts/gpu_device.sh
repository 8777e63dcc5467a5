#!/usr/bin/env bash
# The numeric CUDA checks and `bench gpu` on a lent GPU machine, which has the
# CUDA toolkit but no Rust: `build` (here) compiles the CUDA test binaries and
# examples into .devbin/ (stripped, ignored by git); `run` (there) finds
# libnvrtc/libcublas/ptxas, runs the numeric tests, the ptxas checks, the
# bench, GPU training runs (alternated with an older build's train_mlp when
# one is copied in as .devbin/train_mlp_old) and compute-sanitizer's
# racecheck, and leaves the logs under $OUT (or /tmp/gpu-logs).
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
build)
    set -e
    mkdir -p .devbin
    for t in cuda layers nvrtc conv cnn seq graph pool; do
        exe=$(cargo test --release -p brgemm-gpu --test "$t" --no-run --message-format=json 2>/dev/null |
            sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
        strip -o ".devbin/$t" "$exe"
    done
    cargo build -q --release --features cuda --example bench --example train_mlp --example train_cnn --example train_lstm
    for e in bench train_mlp train_cnn train_lstm; do strip -o ".devbin/$e" "target/release/examples/$e"; done
    # Fashion-MNIST for train_cnn (the GPU machine has no Debian package).
    if [ -d /usr/share/datasets/fashion-mnist ]; then
        mkdir -p .devbin/fashion && cp /usr/share/datasets/fashion-mnist/*.gz .devbin/fashion/
    fi
    ls -la .devbin
    ;;
run)
    out=${OUT:-/tmp/gpu-logs}
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv
    # cudarc asks for the unversioned names too: link whichever CUDA release is here.
    mkdir -p /tmp/cudalibs
    for l in nvrtc cublas cublasLt; do
        f=$(ls /usr/local/cuda/lib64/lib$l.so.[0-9]* 2>/dev/null | head -1)
        [ -n "$f" ] || f=$(find /opt /usr -name "lib$l.so.[0-9]*" 2>/dev/null | head -1)
        echo "lib$l: $f"
        [ -n "$f" ] && ln -sf "$f" "/tmp/cudalibs/lib$l.so" && ln -sf "$f" "/tmp/cudalibs/lib$l.so.12"
        [ -n "$f" ] && export LD_LIBRARY_PATH="$(dirname "$f"):/tmp/cudalibs:${LD_LIBRARY_PATH:-}"
    done
    export BRGEMM_PTXAS=$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)
    "$BRGEMM_PTXAS" --version | tail -1
    step() { # name, limit, command...
        local n=$1 s=$2; shift 2
        local t0=$(date +%s%N)
        timeout "$s" "$@" >"$out/$n.log" 2>&1
        local rc=$?
        printf '%-12s rc=%-3s %6d ms\n' "$n" "$rc" $((($(date +%s%N) - t0) / 1000000)) | tee -a "$out/summary.txt"
        grep -E '^(test |skipped|CUDA device|\{"bench|test_accuracy|device:|thread .* panicked|=====.*(ERROR|RACE)|RACECHECK SUMMARY|[0-9]+ sm_90a)' "$out/$n.log" | head -40
        return $rc
    }
    export BRGEMM_REQUIRE_CUDA=1
    # ONLY=cnn or ONLY=lstm: just that model's checks and training runs
    # (CNN_ARGS: more train_cnn options, e.g. --batchnorm).
    if [ "${ONLY:-}" = cnn ]; then
        # The convolution and CNN checks, then train_cnn on the GPU and, for
        # its accuracy, on this machine's CPUs.
        step conv 90 .devbin/conv --nocapture cuda
        step cnn 90 .devbin/cnn --nocapture cuda
        for dt in f32 bf16; do
            step "train_cnn_$dt" 120 .devbin/train_cnn --device cuda --data .devbin/fashion --dtype "$dt" ${CNN_ARGS:-}
            grep -E "^epoch|trained in" "$out/train_cnn_$dt.log"
        done
        step train_cnn_cpu 120 .devbin/train_cnn --data .devbin/fashion ${CNN_ARGS:-}
        grep -E "^epoch|trained in" "$out/train_cnn_cpu.log"
        cat "$out/summary.txt"
        exit 0
    fi
    if [ "${ONLY:-}" = lstm ]; then
        # The LSTM checks, then train_lstm (2 epochs) on the GPU and on
        # this machine's CPUs.
        step seq 90 .devbin/seq --nocapture cuda
        for dt in f32 bf16; do
            step "train_lstm_$dt" 120 .devbin/train_lstm --device cuda --data .devbin/fashion --epochs 2 --dtype "$dt"
            grep -E "^epoch|trained in" "$out/train_lstm_$dt.log"
        done
        step train_lstm_cpu 120 .devbin/train_lstm --data .devbin/fashion --epochs 2
        grep -E "^epoch|trained in" "$out/train_lstm_cpu.log"
        cat "$out/summary.txt"
        exit 0
    fi
    # The sm_90a kernel first: every later step may run it (Auto), so a
    # failure or a hang there stops the run early.
    if step wgmma 60 .devbin/cuda --nocapture wgmma; then
        step sweep 90 .devbin/cuda --nocapture sweep
        step bench 90 .devbin/bench gpu --device cuda
        step layers 60 .devbin/layers --nocapture cuda
        step conv 90 .devbin/conv --nocapture cuda
        step pool 60 .devbin/pool --nocapture cuda
        step graph 120 .devbin/graph --nocapture cuda
        step seq 90 .devbin/seq --nocapture cuda
        step train_mlp 30 .devbin/train_mlp --device cuda --epochs 3
        step train_bf16 30 .devbin/train_mlp --device cuda --epochs 3 --dtype bf16
        # An older build's train_mlp beside this one (copied in as
        # .devbin/train_mlp_old), alternated: speed compared in one session.
        if [ -x .devbin/train_mlp_old ]; then
            for round in 1 2; do
                for b in train_mlp_old train_mlp; do
                    step "${b}_$round" 60 .devbin/$b --device cuda --epochs 10
                    grep -E "^epoch +10 |trained in" "$out/${b}_$round.log"
                done
            done
        fi
        step racecheck 90 compute-sanitizer --tool racecheck --print-limit 8 .devbin/cuda --nocapture wgmma
    else
        tail -30 "$out/wgmma.log"
    fi
    # The ptxas checks with this machine's toolkit (NVRTC=0 skips them).
    [ "${NVRTC:-1}" = 1 ] && step nvrtc 90 .devbin/nvrtc --nocapture
    cat "$out/summary.txt"
    ;;
*)
    echo "usage: scripts/gpu_device.sh build|run" >&2
    exit 2
    ;;
esac

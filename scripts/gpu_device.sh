#!/usr/bin/env bash
# The numeric CUDA checks and `bench gpu` on a lent GPU machine, which has the
# CUDA toolkit but no Rust: `build` (here) compiles the CUDA test binaries and
# examples into .devbin/ (stripped, ignored by git) and packs them into
# .devpack/ (the path to carry); `run` (there) unpacks them, finds
# libnvrtc/libcublas/ptxas, runs the numeric tests, the ptxas checks, the
# bench, GPU training runs (alternated with an older build's train_mlp when
# one is copied in as .devbin/train_mlp_old) and compute-sanitizer's
# racecheck, and leaves the logs under $OUT (or /tmp/gpu-logs); ONLY=cnn,
# lstm, graph, mma or kernel runs one group (see each below).
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
    cargo build -q --release --features cuda --example bench --example train_mlp --example train_cnn --example train_lstm --example train_resnet
    for e in bench train_mlp train_cnn train_lstm train_resnet; do strip -o ".devbin/$e" "target/release/examples/$e"; done
    # Fashion-MNIST for train_cnn (the GPU machine has no Debian package).
    if [ -d /usr/share/datasets/fashion-mnist ]; then
        mkdir -p .devbin/fashion && cp /usr/share/datasets/fashion-mnist/*.gz .devbin/fashion/
    fi
    # What travels to the GPU machine is capped (64 MiB): the binaries go
    # xz-packed in .devpack/ (about a twelfth of their size), with the data.
    rm -rf .devpack && mkdir -p .devpack
    (cd .devbin && tar cJf ../.devpack/bin.tar.xz --exclude=fashion .)
    [ -d .devbin/fashion ] && cp -r .devbin/fashion .devpack/
    ls -la .devbin .devpack
    ;;
run)
    # Carried as .devpack (see build): unpacked into .devbin here.
    if [ -f .devpack/bin.tar.xz ]; then
        mkdir -p .devbin && tar xJf .devpack/bin.tar.xz -C .devbin
        [ -d .devpack/fashion ] && [ ! -d .devbin/fashion ] && cp -r .devpack/fashion .devbin/
    fi
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
    # ONLY=mma: the mma.sync ceiling (scripts/mma_peak.cu, built here with
    # nvcc), the CUDA sweep through both kernels, `bench gpu`, then the
    # FC/MLP and CNN checks (other batch forms through the same loads).
    if [ "${ONLY:-}" = mma ]; then
        arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
        nvcc -O3 -arch="sm_$arch" -o /tmp/mma_peak scripts/mma_peak.cu &&
            step mma_peak 60 /tmp/mma_peak && cat "$out/mma_peak.log"
        step sweep 90 .devbin/cuda --nocapture sweep
        step bench 120 .devbin/bench gpu --device cuda
        step layers 60 .devbin/layers --nocapture cuda
        step cnn 90 .devbin/cnn --nocapture cuda
        cat "$out/summary.txt"
        exit 0
    fi
    # ONLY=kernel: after a change to the mma.sync kernel, the checks of the
    # layers that run it with tables (convolution, CNN, small ResNet), the
    # bench, and train_cnn / train_resnet on the GPU.
    if [ "${ONLY:-}" = kernel ]; then
        step conv 90 .devbin/conv --nocapture cuda
        step graph 60 .devbin/graph --nocapture small_resnet_matches_the_cpu_graph_on_cuda
        step bench 120 .devbin/bench gpu --device cuda
        step train_cnn 90 .devbin/train_cnn --device cuda --data .devbin/fashion --epochs 2
        grep -E "^epoch|test_accuracy" "$out/train_cnn.log"
        step train_resnet 150 .devbin/train_resnet --device cuda --data .devbin/fashion --epochs 2 --train-limit 20000
        grep -E "^epoch|test_accuracy" "$out/train_resnet.log"
        cat "$out/summary.txt"
        exit 0
    fi
    # ONLY=graph: the layer-graph checks (strided convolution, pooling,
    # dropout, GpuGraph, RNN cells), then train_resnet, train_cnn --dropout
    # and train_lstm --rnn on the GPU and on this machine's CPUs; steps
    # that would start after DEADLINE seconds (default 420) are skipped.
    if [ "${ONLY:-}" = graph ]; then
        t_end=$(($(date +%s) + ${DEADLINE:-420}))
        try() { # like step, unless the deadline has passed
            if [ "$(date +%s)" -ge "$t_end" ]; then
                echo "$1 skipped (deadline)" | tee -a "$out/summary.txt"
                return 0
            fi
            step "$@"
        }
        try conv 90 .devbin/conv --nocapture cuda
        try pool 60 .devbin/pool --nocapture cuda
        try graph 120 .devbin/graph --nocapture
        try seq 90 .devbin/seq --nocapture cuda
        try cnn 90 .devbin/cnn --nocapture cuda
        try layers 60 .devbin/layers --nocapture cuda
        r="--data .devbin/fashion --epochs 2 --train-limit 20000"
        for d in cuda cpu; do
            try "train_resnet_$d" 150 .devbin/train_resnet --device $d $r
            grep -E "^epoch|trained in|test_accuracy" "$out/train_resnet_$d.log"
        done
        try train_resnet_bf16 150 .devbin/train_resnet --device cuda --dtype bf16 $r
        grep -E "^epoch|test_accuracy" "$out/train_resnet_bf16.log"
        for d in cuda cpu; do
            try "train_dropout_$d" 90 .devbin/train_cnn --device $d --data .devbin/fashion --dropout 0.25 --epochs 2
            grep -E "^epoch|test_accuracy" "$out/train_dropout_$d.log"
            try "train_rnn_$d" 90 .devbin/train_lstm --device $d --data .devbin/fashion --rnn --epochs 2
            grep -E "^epoch|test_accuracy" "$out/train_rnn_$d.log"
        done
        try bench 90 .devbin/bench gpu --device cuda
        try nvrtc 90 .devbin/nvrtc --nocapture
        cat "$out/summary.txt"
        exit 0
    fi
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

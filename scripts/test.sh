#!/usr/bin/env bash
# Installs what the tests need on a fresh Debian/Ubuntu machine (as root or
# with sudo) and runs every test of the workspace:
#   - all crates, all targets, doc tests, on this machine's ISAs;
#   - the BRGEMM_ISA override, once per ISA, and the primitives on each;
#   - a short CNN run on Fashion-MNIST (Debian package dataset-fashion-mnist);
#   - the NEON kernels for real: cross-built for aarch64 and run under qemu;
#   - Miri over the portable/reference kernels and the primitives' small
#     tests, and the cargo fuzz targets for 20 s each (both on nightly);
#   - the GPU crate: generated kernels executed on OpenCL (PoCL, on the CPU),
#     every CUDA variant compiled by NVRTC and assembled by ptxas (both from
#     PyPI wheels), numeric CUDA tests where a GPU is present;
#   - the emulated cluster (scripts/cluster.sh): two network namespaces on
#     rate-limited links, train_mpi over TCP between them, where this
#     machine lets the script make namespaces (root).
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi

say() { printf '\n== %s\n' "$*"; }

# ---- install -------------------------------------------------------------
pkgs=()
command -v aarch64-linux-gnu-gcc >/dev/null || pkgs+=(gcc-aarch64-linux-gnu)
[ -e /usr/aarch64-linux-gnu/lib/libc.so.6 ] || pkgs+=(libc6-dev-arm64-cross)
command -v qemu-aarch64 >/dev/null || pkgs+=(qemu-user)
# MPI (brgemm-distributed): OpenMPI, and libclang for rsmpi's bindgen.
command -v mpirun >/dev/null || pkgs+=(openmpi-bin)
[ -e /usr/include/x86_64-linux-gnu/openmpi/mpi.h ] || [ -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] \
  || [ -n "$(find /usr/lib /usr/include -name mpi.h -path '*openmpi*' 2>/dev/null | head -1)" ] || pkgs+=(libopenmpi-dev)
ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1 && [ -n "$(find /usr/lib/llvm-* -name stddef.h 2>/dev/null | head -1)" ] \
  || pkgs+=(libclang-dev)
# OpenCL on the CPU (PoCL) and its ICD loader, for the GPU crate's twin kernels.
[ -e /etc/OpenCL/vendors/pocl.icd ] || pkgs+=(pocl-opencl-icd)
ls /usr/lib/*/libOpenCL.so.1 >/dev/null 2>&1 || pkgs+=(ocl-icd-libopencl1)
# A virtualenv for the NVRTC/ptxas wheels (Debian's python3 lacks ensurepip).
python3 -c 'import ensurepip, venv' 2>/dev/null || pkgs+=(python3-venv)
# The emulated cluster: ip/tc (iproute2) and taskset (util-linux).
command -v ip >/dev/null && command -v tc >/dev/null || pkgs+=(iproute2)
command -v taskset >/dev/null || pkgs+=(util-linux)
# Fashion-MNIST (IDX files in /usr/share/datasets/fashion-mnist) for the CNN tests.
[ -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || pkgs+=(dataset-fashion-mnist)
if [ ${#pkgs[@]} -gt 0 ]; then
  say "installing ${pkgs[*]}"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}"
fi
# Nightly with Miri and cargo-fuzz: the Miri step and the fuzz targets' short runs.
if ! rustup toolchain list | grep -q '^nightly'; then
  say "adding the nightly toolchain (cargo fuzz)"
  rustup toolchain install nightly --profile minimal
fi
if ! cargo +nightly miri --version >/dev/null 2>&1; then
  say "adding Miri to the nightly toolchain"
  rustup component add --toolchain nightly miri rust-src
fi
if ! command -v cargo-fuzz >/dev/null; then
  say "installing cargo-fuzz"
  cargo install -q cargo-fuzz --locked
fi
if ! rustup target list --installed | grep -qx aarch64-unknown-linux-gnu; then
  say "adding the aarch64 Rust target"
  rustup target add aarch64-unknown-linux-gnu
fi

# NVRTC and ptxas from PyPI: the CUDA sources compile here without a GPU or
# a CUDA install. The wheel ships libnvrtc.so.12 (no unversioned name, which
# cudarc does not need).
venv=target/gpu-venv
if [ ! -x "$venv/bin/ptxas-ok" ]; then
  say "NVRTC and ptxas wheels into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --no-cache-dir nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-nvcc-cu12==12.9.86
  touch "$venv/bin/ptxas-ok" && chmod +x "$venv/bin/ptxas-ok"
fi
nv=$(echo "$PWD/$venv"/lib/python3*/site-packages/nvidia)
export LD_LIBRARY_PATH="$nv/cuda_nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export BRGEMM_PTXAS="$nv/cuda_nvcc/bin/ptxas"
# The GPU tests fail instead of skipping without OpenCL or NVRTC/ptxas
# (the numeric CUDA tests still skip, saying so, without a GPU).
export BRGEMM_REQUIRE_OPENCL=1 BRGEMM_REQUIRE_NVRTC=1

# The ISAs this CPU has, read from /proc/cpuinfo (independently of the
# crate's own detection): the kernel tests fail if any of them is not run.
req=portable,reference
if [ "$(uname -m)" = x86_64 ]; then
  flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
  [[ " $flags " == *" avx512f "* ]] && req+=,avx512
  [[ " $flags " == *" avx2 "* && " $flags " == *" fma "* ]] && req+=,avx2
elif [ "$(uname -m)" = aarch64 ]; then
  req+=,neon
fi
export BRGEMM_REQUIRE_ISAS=$req
# The CNN test on Fashion-MNIST fails instead of skipping without the data.
export BRGEMM_REQUIRE_FASHION=1
# The emulated cluster's test (tests/cluster.rs) runs, and must pass,
# wherever this script can make a network namespace.
if ip netns add brgc-probe 2>/dev/null; then
  ip netns del brgc-probe
  export BRGEMM_REQUIRE_CLUSTER=1
fi

# ---- tests on this machine -------------------------------------------------
# One build serves every step below. A `cargo test -p X` or a second feature
# set would resolve features anew and compile another copy of every dependency
# (the CI disk ran out that way), so the per-ISA reruns start the test
# binaries of this build directly; incremental caches are no use to CI.
export CARGO_INCREMENTAL=0
feats=(--workspace --features mpi,cuda)

say "cargo fmt --check"
cargo fmt --all -- --check

# The examples as programs, with the tests' profile and features (shared
# deps): tests/examples_cli.rs runs them from target/debug/examples, which
# `cargo test --all-targets` does not fill (it builds examples as tests).
cargo build -q "${feats[@]}" --profile test --examples
ex=target/debug/examples

say "workspace tests, MPI included (required ISAs: $req)"
BRGEMM_EXAMPLES_BUILT=1 cargo test "${feats[@]}" --all-targets
cargo test "${feats[@]}" --doc
cargo test "${feats[@]}" --all-targets --no-run --message-format=json -q > target/ci-test-binaries.json

# run_tests DIR [TEST...]: the test binaries built above for the package in
# DIR (its lib, bins and integration tests, or only the named tests), each
# run from DIR as `cargo test` would.
run_tests() {
  local dir=$PWD/$1 lines line
  shift
  mapfile -t lines < <(python3 - target/ci-test-binaries.json "$dir" "$@" <<'PY'
import json, os, sys
pkg_dir, names = sys.argv[2], set(sys.argv[3:])
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m["profile"]["test"]:
        continue
    if os.path.dirname(m["manifest_path"]) != pkg_dir:
        continue
    t = m["target"]
    if names:
        if "test" not in t["kind"] or t["name"] not in names:
            continue
    elif "example" in t["kind"] or "bench" in t["kind"]:
        continue
    print(m["executable"])
PY
  )
  [ ${#lines[@]} -gt 0 ] || { echo "no test binaries for $dir $*"; exit 1; }
  for line in "${lines[@]}"; do
    echo "  ${line##*/}"
    (cd "$dir" && "$line" -q)
  done
}

say "API docs build without warnings (broken intra-doc links fail)"
RUSTDOCFLAGS="-D warnings" cargo doc -q "${feats[@]}" --no-deps

say "train_mlp on the OpenCL device (the GPU code path, on PoCL)"
out=$($ex/train_mlp --device opencl --epochs 10)
echo "$out" | tail -3
acc=$(echo "$out" | sed -n 's/^test_accuracy=//p')
[ -n "$acc" ] && awk -v a="$acc" 'BEGIN { exit !(a >= 0.9) }' || { echo "train_mlp --device opencl: test_accuracy '$acc' < 0.9"; exit 1; }

say "train_mpi under mpirun, 2 ranks"
out=$(mpirun --allow-run-as-root --oversubscribe --timeout 120 -np 2 $ex/train_mpi --epochs 3)
echo "$out" | tail -4
echo "$out" | grep -q '^test_accuracy=' || { echo "train_mpi printed no test_accuracy line"; exit 1; }
say "train_mpi --model resnet (the small ResNet, batch norm per rank), 2 ranks"
out=$(mpirun --allow-run-as-root --oversubscribe --timeout 300 -np 2 $ex/train_mpi --model resnet --epochs 1 --train-limit 512)
echo "$out" | tail -2
echo "$out" | grep -q '^test_accuracy=' || { echo "train_mpi --model resnet printed no test_accuracy line"; exit 1; }

say "bf16: AMX permission refused (BRGEMM_AMX_DENY) falls back"
BRGEMM_AMX_DENY=1 run_tests brgemm bf16

say "mixed-precision FC, convolution and LSTM/RNN on every bf16 kernel this CPU has"
bf16_isas="reference fp32"
if [ "$(uname -m)" = x86_64 ] && grep -m1 '^flags' /proc/cpuinfo | grep -qw avx512_bf16; then
  bf16_isas+=" avx512bf16"
fi
for isa in $bf16_isas; do
  BRGEMM_BF16_ISA=$isa run_tests primitives fc_bf16
  BRGEMM_BF16_ISA=$isa run_tests primitives conv
  BRGEMM_BF16_ISA=$isa run_tests primitives rnn
  BRGEMM_BF16_ISA=$isa run_tests nn mixed_precision
done

say "BRGEMM_ISA override, one run per ISA"
for isa in avx512 avx2 neon portable reference bogus; do
  BRGEMM_ISA=$isa run_tests brgemm env_isa exact
done

# The primitives on every kernel ISA of this CPU; their element-wise loops
# (widest!) follow BRGEMM_ISA too, so this also runs each compiled version.
say "primitives and the layer graph per ISA: ${req//,/ }"
for isa in ${req//,/ }; do
  BRGEMM_ISA=$isa run_tests primitives
  BRGEMM_ISA=$isa run_tests nn
done

# ---- Miri ---------------------------------------------------------------------
# The portable and reference kernels and the primitives' small tests under
# Miri (undefined behaviour, out-of-bounds pointer arithmetic, data races),
# with few proptest cases: Miri interprets ~1000x slower than native code.
# Tree Borrows and ignored leaks: crossbeam-epoch (under rayon) breaks the
# experimental Stacked Borrows rules and never frees its global collector;
# neither is this project's code. Isolation off: the tests write temp files.
say "Miri: kernels (portable, reference) and the primitives' small tests"
export MIRIFLAGS="-Zmiri-disable-isolation -Zmiri-tree-borrows -Zmiri-permissive-provenance -Zmiri-ignore-leaks"
# The kernel sweeps' shapes (up to 96^3, batch 20) take minutes per case
# under Miri: the exact tests (identities, batches, padded lda and row-major
# B on exactly-sized slices) and the zero batch run on every ISA Miri sees
# (portable, reference).
cargo +nightly miri test -q -p brgemm --test exact --test kernel -- --skip every_register_tile \
  --skip every_supported_isa --skip prefetching_ahead
PROPTEST_CASES=2 cargo +nightly miri test -q -p brgemm-primitives --lib -- layout:: guard::
PROPTEST_CASES=2 cargo +nightly miri test -q -p brgemm-primitives --test hostile
unset MIRIFLAGS

# ---- fuzzing ----------------------------------------------------------------
# A short run of each target from the committed seeds; a crash fails the run
# (cargo fuzz exits non-zero and leaves the input under fuzz/artifacts/).
say "cargo fuzz: 20 s per target"
for t in loop_spec tuning_file idx model_file; do
  mkdir -p fuzz/corpus/$t
  log=target/fuzz-$t.log
  if ! (cd fuzz && cargo +nightly fuzz run $t corpus/$t seeds/$t -- -max_total_time=20) > "$log" 2>&1; then
    tail -n 40 "$log"
    echo "cargo fuzz: target $t failed"
    exit 1
  fi
  echo "  $t: $(grep -E '^Done' "$log")"
done

# ---- NEON under qemu -------------------------------------------------------
if [ "$(uname -m)" != aarch64 ]; then
  say "brgemm on aarch64 under qemu (NEON kernels)"
  export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
  export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
  # Emulation is ~50x slower: fewer proptest cases.
  PROPTEST_CASES=24 BRGEMM_REQUIRE_ISAS=neon,portable,reference \
    cargo test -p brgemm --target aarch64-unknown-linux-gnu
fi

say "all tests passed"

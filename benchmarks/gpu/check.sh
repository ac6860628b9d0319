#!/usr/bin/env bash
# The prepared device check for a CUDA machine, each step bounded in time. Steps (default: tests kernels):
#   tests    the whole test suite with the device left at "auto", so every engine test runs on CUDA (pytest-xdist
#            spreads it over the cores where installed; modules needing packages the machine lacks are reported as
#            collection errors, not run), then a JUnit file naming each test's outcome
#   kernels  benchmarks/gpu/bench_kernels.py: each Triton kernel against its torch baseline
#   offload  benchmarks/gpu/offload_vs_accelerate.py at BUDGET (default 4GB): a few minutes
#   moe      benchmarks/moe.py on CUDA, one round: expert streaming (cold experts by the cost model, all copied, all
#            on the CPU) against whole layers
#   speculate  benchmarks/speculative.py --methods self on CUDA: SmolLM2 streamed from pinned host RAM (140 MiB on the
#            device), its int4 copy drafting 8 tokens on the CPU: tokens a pass and tokens/s against plain streaming
# Results land in $OUT (when the device tool sets it) or benchmarks/results/.
# Usage: bash benchmarks/gpu/check.sh [STEP ...]   (in the environment: BUDGET=4GB, TEST_ARGS="tests/tiers", and
# TEST_LIMIT, KERNEL_LIMIT, MOE_LIMIT, SPEC_LIMIT in seconds, MOE_BATCHES=1,8)
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests kernels)

step() {  # step NAME SECONDS COMMAND...: run it under a time limit, its output teed to $out/gpu_NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit}s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/gpu_$name.log"
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start))s"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu_nvidia_smi.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$out/gpu_nvidia_smi.txt"
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n "$(($(nproc) < 12 ? $(nproc) : 12))")
timeouts=()
python3 -c "import pytest_timeout" 2>/dev/null && timeouts=(--timeout 150)
for s in "${steps[@]}"; do
    case "$s" in
        tests) step tests "${TEST_LIMIT:-300}" pytest -v -rfE --tb=short -p no:cacheprovider \
            --continue-on-collection-errors --durations 25 "${workers[@]}" "${timeouts[@]}" --junitxml "$out/gpu_junit.xml" \
            ${TEST_ARGS:-tests} ;;
        kernels) step kernels "${KERNEL_LIMIT:-120}" python3 benchmarks/gpu/bench_kernels.py --iters 20 --warmup 5 \
            --out "$out/gpu_kernels.json" ;;
        offload) step offload 420 python3 benchmarks/gpu/offload_vs_accelerate.py --budget "${BUDGET:-4GB}" \
            --out "$out/gpu_offload_vs_accelerate.json" ;;
        moe) step moe "${MOE_LIMIT:-300}" python3 benchmarks/moe.py --repeats 1 --batches "${MOE_BATCHES:-1,8}" \
            --new-tokens 16 --work-dir /tmp/offload-bench \
            --engines experts,experts-cold-device,experts-cold-cpu,layers --out "$out/gpu_moe.json" ;;
        speculate) step speculate "${SPEC_LIMIT:-300}" python3 benchmarks/speculative.py --methods self --k 8 \
            --host-memory 1GiB --quick --work-dir /tmp/offload-bench --out "$out/gpu_speculative.json" ;;
        *) echo "unknown step $s (tests, kernels, offload, moe, speculate)"; exit 2 ;;
    esac
done

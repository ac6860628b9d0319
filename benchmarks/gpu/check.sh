#!/usr/bin/env bash
# The prepared device check for a CUDA machine (a few minutes): the GPU-marked tests, the kernel benchmark, then the
# offload benchmark.
# Results land in $OUT (when the device tool sets it) and benchmarks/results/. Usage: bash benchmarks/gpu/check.sh [BUDGET]
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu_nvidia_smi.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$out/gpu_tests.log"
python3 benchmarks/gpu/bench_kernels.py --out "$out/gpu_kernels.json" 2>&1 | tee "$out/gpu_kernels.log"
python3 benchmarks/gpu/offload_vs_accelerate.py --budget "${1:-4GB}" --out "$out/gpu_offload_vs_accelerate.json" 2>&1 \
    | tee "$out/gpu_bench.log"

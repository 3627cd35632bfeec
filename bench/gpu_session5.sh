#!/usr/bin/env bash
# Confirmation on one H200: the GPU tests (graphs against eager with overlap, float32 7B
# against transformers, kernels) and the engine bench against transformers.
set -u
out=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py tests/engine/test_kernels.py \
  "tests/engine/test_fast_model.py::test_fast_path_greedy_equals_transformers" 2>&1 | tee "$out/test_gpu.log" | grep -E "passed|failed|^FAILED|^E  " | head
timeout 230 python3 bench/gpu_engine.py --json "$out/gpu_engine.json" --profile "$out/profile.txt" 2>&1 | tee "$out/gpu_engine.log" | grep -v Warning | tail -14

#!/usr/bin/env bash
# The llama3-rope fast-model test alone and in its file, then the engine bench with the
# end-to-end pairs (pdserve up --mode unified on the GPU against the offline engine).
set -u
out=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR
timeout 120 python3 -m pytest -q -p no:cacheprovider "tests/engine/test_fast_model.py::test_fast_path_greedy_equals_transformers[llama3-rope]" 2>&1 | tail -3
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_fast_model.py tests/engine/test_gpu.py 2>&1 | tee "$out/test_gpu.log" | grep -E "passed|failed|^FAILED|^E  " | head
timeout 520 python3 bench/gpu_engine.py --e2e --json "$out/gpu_engine.json" 2>&1 | tee "$out/gpu_engine.log" | grep -v Warning | tail -22

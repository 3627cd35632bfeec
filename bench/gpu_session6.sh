#!/usr/bin/env bash
# One H200: the GPU tests (kernels, graphs, greedy equality, the batch-1 launch options),
# then the engine bench with programmatic dependent launches and the L2 prefetch tried at
# batch 1, a profile, and the end-to-end pairs with each process's CPU per token and
# py-spy stacks of the pipeline. About 6 minutes.
set -u
out=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py tests/engine/test_kernels.py \
  "tests/engine/test_fast_model.py::test_fast_path_greedy_equals_transformers" 2>&1 | tee "$out/test_gpu.log" | grep -E "passed|failed|^FAILED|^E  " | head
timeout 400 python3 bench/gpu_engine.py --json "$out/gpu_engine.json" --profile "$out/profile.txt" --try-pdl --try-l2-prefetch \
  --e2e --e2e-profile "$out/e2e_pyspy.txt" 2>&1 | tee "$out/gpu_engine.log" | grep -v Warning | tail -24
rm -f "$out"/trace_prefill.json

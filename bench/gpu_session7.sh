#!/usr/bin/env bash
# One H200, one call (about 6 minutes): the GPU tests (kernels, graphs, greedy equality,
# the batch-1 launch options), the engine bench with its profile and the end-to-end pairs,
# then structured output's cost on the 7B stand-in (random weights; the schema's fixed
# shape ends every constrained request). Needs no Mooncake or py-spy wheels.
set -u
out=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py tests/engine/test_kernels.py \
  "tests/engine/test_fast_model.py::test_fast_path_greedy_equals_transformers" 2>&1 | tee "$out/test_gpu.log" | grep -E "passed|failed|^FAILED|^E  " | head
timeout 330 python3 bench/gpu_engine.py --json "$out/gpu_engine.json" --profile "$out/profile.txt" --e2e \
  2>&1 | tee "$out/gpu_engine.log" | grep -v Warning | tail -16
rm -f "$out"/trace_prefill.json "$out"/trace_decode64.json
python3 bench/make_dummy_model.py --out /tmp/m7b >/dev/null
timeout 240 python3 bench/structured_output.py --model-path /tmp/m7b --extra "--device cuda --load-format dummy" \
  --out "$out/structured_output_gpu.json" 2>&1 | tee "$out/structured_output.log" | grep -v Warning | tail -8

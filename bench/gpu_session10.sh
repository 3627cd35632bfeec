#!/usr/bin/env bash
# One H200, one call (about 8 minutes): the GPU tests, the engine bench with the end-to-end
# pairs at four waves of 64 in flight (warm client connections) and the worker's step
# timeline, the one-wave pairs beside them, then structured output's cost with its step
# timeline, and the host's grammar work per step (masks, accepts; bench/probes/grammar_host.py).
# Needs no Mooncake or py-spy wheels.
set -u
out=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py tests/engine/test_kernels.py tests/engine/test_sampler.py \
  "tests/engine/test_fast_model.py::test_fast_path_greedy_equals_transformers" 2>&1 | tee "$out/test_gpu.log" | grep -E "passed|failed|^FAILED|^E  " | head
timeout 300 python3 bench/gpu_engine.py --json "$out/gpu_engine.json" --profile "$out/profile.txt" --e2e \
  --e2e-api-processes 2 --e2e-step-log > "$out/gpu_engine_steps.log" 2>&1
grep -v " step \|Warning\|DEBUG" "$out/gpu_engine_steps.log" | tail -14
rm -f "$out"/trace_prefill.json "$out"/trace_decode64.json
python3 bench/probes/step_timeline.py "$out/gpu_engine_steps.log" "$out/gpu_engine.json" --out "$out/gpu_engine_timeline.json"
timeout 150 python3 bench/gpu_engine.py --json "$out/gpu_engine_e2e_one_wave.json" --only-e2e --e2e-waves 1 \
  --e2e-api-processes 2 2>&1 | tail -4
python3 bench/make_dummy_model.py --out /tmp/m7b >/dev/null
timeout 240 python3 bench/structured_output.py --model-path /tmp/m7b --extra "--device cuda --load-format dummy --log-level DEBUG" \
  --out "$out/structured_output_gpu.json" > "$out/structured_output.log" 2>&1
grep "^{\|median" "$out/structured_output.log" | cut -c1-150
timeout 120 python3 bench/probes/grammar_host.py --out "$out/grammar_host.json" 2>&1 | tail -6

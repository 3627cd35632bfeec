#!/usr/bin/env bash
# One H200, one call (about 4 minutes): structured output's cost with each unconstrained
# request as long as its constrained twin, then the end-to-end pairs alone, both with the
# unified worker's step timeline (--log-level DEBUG), the pipeline driven by four client
# processes (one Python client reads ~10k streamed tokens/s: it was the bottleneck).
# Needs no Mooncake or py-spy wheels.
set -u
out=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR
python3 bench/make_dummy_model.py --out /tmp/m7b >/dev/null
timeout 240 python3 bench/structured_output.py --model-path /tmp/m7b --extra "--device cuda --load-format dummy --log-level DEBUG" \
  --out "$out/structured_output_gpu.json" > "$out/structured_output.log" 2>&1
grep -v " step \|Warning\|DEBUG" "$out/structured_output.log" | tail -8
timeout 300 python3 bench/gpu_engine.py --json "$out/gpu_engine_e2e.json" --only-e2e --e2e-api-processes 2 \
  --e2e-step-log > "$out/e2e.log" 2>&1
grep -v " step \|Warning\|DEBUG" "$out/e2e.log" | tail -8

#!/usr/bin/env bash
# One H200, one call (about 3 minutes): the sampler tests on the GPU, then structured
# output's cost with the worker's step timeline (--log-level DEBUG; per round: steps and the
# interval between full-batch steps). Needs no Mooncake or py-spy wheels.
set -u
out=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_sampler.py 2>&1 | tail -2
python3 bench/make_dummy_model.py --out /tmp/m7b >/dev/null
timeout 240 python3 bench/structured_output.py --model-path /tmp/m7b --extra "--device cuda --load-format dummy --log-level DEBUG" \
  --out "$out/structured_output_gpu.json" > "$out/structured_output.log" 2>&1
grep "^{\|median" "$out/structured_output.log" | cut -c1-150

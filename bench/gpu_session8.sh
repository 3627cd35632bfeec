#!/usr/bin/env bash
# One H200, one call (about 5 minutes): the end-to-end pairs alone with the unified
# worker's step timeline (--log-level DEBUG) and the clients' start and finish on the same
# clock, driven by one client process and then by four. Needs no Mooncake or py-spy wheels.
set -u
out=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR
for clients in 1 4; do
  timeout 270 python3 bench/gpu_engine.py --json "$out/gpu_engine_e2e_c$clients.json" --only-e2e --e2e-api-processes 2 \
    --e2e-step-log --e2e-client-processes $clients > "$out/e2e_c$clients.log" 2>&1
  grep -v " step \|Warning\|DEBUG" "$out/e2e_c$clients.log" | tail -2
done

#!/usr/bin/env bash
# GPU fast path on one H200, in one call: the GPU tests, a numerics diagnosis against
# transformers, the decode GEMV probe, then the engine against transformers
# (bench/gpu_engine.py) with a device-time profile and Chrome traces. Expects the wheels
# from ../shared/tools/device-bundle installed (PYTHONPATH, PATH, LD_LIBRARY_PATH) and
# $OUT to collect logs (session.log holds every step's output). Each step has its own
# timeout. Switches: TESTS=0, DIAG=0, PROBE=0, E2E=1.
set -u
out=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$out"
log="$out/session.log"
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee -a "$log"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$log"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 420 python3 -m pytest -q -p no:cacheprovider tests/engine/test_kernels.py tests/engine/test_fast_model.py \
    tests/engine/test_gpu.py 2>&1 | tee "$out/test_gpu.log" | grep -E "passed|failed|^FAILED|^E  " | head -30
fi
[ "${DIAG:-1}" = 1 ] && timeout 150 python3 bench/probes/gpu_diag.py 2>&1 | tee -a "$log" | tail -14
[ "${PROBE:-1}" = 1 ] && timeout 300 python3 bench/probes/gemv_probe.py --json "$out/gemv_probe.json" 2>&1 | tee -a "$log" | grep -v "^  "
extra=()
[ "${E2E:-0}" = 1 ] && extra+=(--e2e)
timeout "${BENCH_TIMEOUT:-480}" python3 bench/gpu_engine.py --json "$out/gpu_engine.json" --profile "$out/profile.txt" \
  "${extra[@]}" 2>&1 | tee -a "$log" | tail -20

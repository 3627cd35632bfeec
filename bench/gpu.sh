#!/usr/bin/env bash
# The GPU measurements, one mode a call (each under the device's ten-minute limit):
#   bash bench/gpu.sh one_gpu_pd     # bench/one_gpu_pd.py: co-located PD against unified on one GPU
# Expects the wheels of ../shared/tools/device-bundle installed (PYTHONPATH, PATH,
# LD_LIBRARY_PATH set); every step has a timeout and its log under $OUT.
# ARGS passes options to the mode's script (e.g. ARGS="--systems colocated,unified-2048").
set -u
out=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR TOKENIZERS_PARALLELISM=false
timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
case "${1:-}" in
one_gpu_pd)
  timeout -k 15 ${LIMIT:-540} python3 bench/one_gpu_pd.py --out "$out/one_gpu_pd.json" --log-dir "$out" ${ARGS:-} 2>&1 \
    | tee "$out/one_gpu_pd.log" | grep -v -E "^WARNING: Logging|Local segment descriptor" | tail -40
  ;;
*)
  echo "usage: bash bench/gpu.sh one_gpu_pd" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Two GPUs of one host (nvidia-h200-x2), one call of about 5 minutes: tensor parallelism on
# the GPUs: the TP tests that can run there, then bench/tensor_parallel.py (decode step at
# batch 1, TP 1 against TP 2, Qwen2.5-7B dimensions, random bf16), with CUDA graphs and, if
# that run fails, without (--no-graphs). Needs the base wheels of ../shared/tools/device-bundle
# installed first (orjson and the rest; Mooncake unused). The JSON lands in
# $OUT/tensor_parallel.json (copy it to docs/data/).
set -u
out=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
timeout 20 nvidia-smi topo -m 2>&1 | tee "$out/gpu.txt"
timeout -k 10 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_parallel.py 2>&1 \
  | tee "$out/test_parallel.log" | grep -E "passed|failed|skipped|^FAILED|^E  " | head
if ! timeout -k 10 240 python3 bench/tensor_parallel.py --json "$out/tensor_parallel.json" > "$out/tensor_parallel.log" 2>&1; then
  tail -30 "$out/tensor_parallel.log"
  timeout -k 10 200 python3 bench/tensor_parallel.py --no-graphs --json "$out/tensor_parallel_no_graphs.json" \
    > "$out/tensor_parallel_no_graphs.log" 2>&1
  tail -5 "$out/tensor_parallel_no_graphs.log"
else
  tail -8 "$out/tensor_parallel.log"
fi

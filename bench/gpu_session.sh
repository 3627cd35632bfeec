#!/usr/bin/env bash
# Everything measured on a lent GPU machine in one call (see docs/performance.md).
# Expects the wheels from ../shared/tools/device-bundle installed (PYTHONPATH, PATH,
# LD_LIBRARY_PATH set) and $OUT to collect logs. Each step has its own timeout.
set -u
out=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"

# 1. engine vs transformers: tiny model and Qwen2.5-7B dimensions (random bf16)
timeout 420 python3 bench/probes/gpu_reading.py --device cuda --json "$out/gpu_reading.json" 2>&1 | tee "$out/gpu_reading.log"

# 2. the whole pipeline on the GPU: pdserve up (prefill + decode on cuda:0, KV over Mooncake tcp)
port=8040
python3 -m pdserve up --device cuda --port $port --host 127.0.0.1 --data-dir /tmp/pd-gpu > "$out/up.log" 2>&1 &
up=$!
for _ in $(seq 1 120); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done
curl -s -X POST localhost:$port/generate -H "Content-Type: application/json" \
  -d '{"text": "請介紹一下你自己","max_new_tokens": 32,"temperature": 0.7}' | tee "$out/seed_curl.json"; echo
timeout 120 python3 -m pdserve bench --base-url http://127.0.0.1:$port --backend generate --num-prompts 64 \
  --max-concurrency 16 --input-len 512 --output-len 64 --output-json "$out/bench_gpu.json" 2>&1 | tail -40 | tee "$out/bench_gpu.log"
kill -TERM $up; wait $up
tail -5 "$out/up.log"

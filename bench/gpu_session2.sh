#!/usr/bin/env bash
# Second GPU session: fp32 greedy equality at 7B dimensions, and the whole pipeline
# (PD and unified) serving a model of Qwen2.5-7B dimensions with random bf16 weights.
set -u
out=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR

python3 bench/make_dummy_model.py --dims qwen2.5-7b --out /tmp/qwen7b > /dev/null
timeout 240 python3 bench/probes/gpu_fp32_check.py 2>&1 | tee "$out/fp32_check.log"

for mode in pd unified; do
  port=8050
  python3 -m pdserve up --mode $mode --unified-workers 1 --device cuda --model-path /tmp/qwen7b --load-format dummy \
    --max-total-tokens 200000 --port $port --host 127.0.0.1 --data-dir /tmp/pd-$mode > "$out/up_$mode.log" 2>&1 &
  up=$!
  for _ in $(seq 1 240); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done
  timeout 60 python3 -m pdserve bench --base-url http://127.0.0.1:$port --backend generate --tokenizer /tmp/qwen7b --num-prompts 8 \
    --max-concurrency 8 --input-len 512 --output-len 16 --quiet > /dev/null 2>&1   # warm-up
  for c in 1 64; do
    n=$([ $c = 1 ] && echo 8 || echo 128)
    timeout 150 python3 -m pdserve bench --base-url http://127.0.0.1:$port --backend generate --tokenizer /tmp/qwen7b --num-prompts $n \
      --max-concurrency $c --input-len 512 --output-len 128 --output-json "$out/bench_${mode}_c$c.json" 2>&1 \
      | grep -E "throughput|TTFT|TPOT|queue|transfer" | tee "$out/bench_${mode}_c$c.txt"
  done
  kill -TERM $up; wait $up
done

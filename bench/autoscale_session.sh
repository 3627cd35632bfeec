#!/usr/bin/env bash
# bench/autoscale_burst.py on a lent machine's CPUs (workers on --device cpu, so the
# many cores of a GPU host give scaling out something to use). Step 1 installs the
# wheels from ../shared/tools/device-bundle (carried as .whl/ and .deb/) and measures what
# one prefill worker computes at full load (1+1, 1,024-token prompts, as many as it takes);
# step 2 runs the burst at a base rate of a quarter of that, so the 10x burst is 2.5 times
# one prefill worker. Usage: bash bench/autoscale_session.sh calibrate|burst
set -u
out=${OUT:-/tmp/pdserve-autoscale}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR TOKENIZERS_PARALLELISM=false
if [ ! -d /tmp/site/nats ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  mkdir -p /tmp/debroot && for f in .deb/*.deb; do dpkg -x "$f" /tmp/debroot; done
fi
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
export LD_LIBRARY_PATH=/tmp/debroot/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
threads=${THREADS:-2}
case "${1:-burst}" in
calibrate)
  nproc | tee "$out/cpus.txt"
  python3 -c "from pdserve.engine.tiny_model import ensure_default_model as e; print(e(__import__('pathlib').Path('/tmp/pdserve-autoscale-burst/model')))"
  port=8050
  python3 -m pdserve up --device cpu --num-threads "$threads" --port $port --host 127.0.0.1 --data-dir /tmp/pd-cal \
    --model-path /tmp/pdserve-autoscale-burst/model/models/pdserve-tiny-qwen2 > "$out/cal_up.log" 2>&1 &
  up=$!
  for _ in $(seq 1 120); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done
  timeout 240 python3 -m pdserve bench --base-url http://127.0.0.1:$port --backend generate --num-prompts 300 \
    --input-len 1024 --output-len 16 --output-json "$out/calibrate.json" 2>&1 | grep -E "throughput|Successful|Failed|TTFT"
  kill -TERM $up; wait $up
  ;;
burst)
  rate=${BASE_RATE:?set BASE_RATE (requests/s) from the calibration}
  timeout 580 python3 bench/autoscale_burst.py --base-rate "$rate" --input-len 1024 --output-len 16 \
    --threads "$threads" --max-prefill "${MAX_PREFILL:-4}" --max-decode "${MAX_DECODE:-2}" \
    --steady-before 15 --burst-seconds 30 --steady-after 60 --warmup 3 --commit "${COMMIT:-}" ${BURST_ARGS:-} \
    --out-data "$out/autoscale_burst.json" --out-img "$out/autoscale_burst.png" 2>&1 | tail -20
  for d in /tmp/pdserve-autoscale-burst/*/; do cp "$d/up.log" "$out/$(basename "$d")_up.log" 2>/dev/null; done
  ;;
esac

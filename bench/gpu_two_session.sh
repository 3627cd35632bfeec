#!/usr/bin/env bash
# Two GPUs of one host (nvidia-h200-x2), one call of under 10 minutes: the point-to-point
# tests (nccl between the GPUs, the gloo protocol), then bench/two_gpu_pd.py: the KV of a
# 4,096-token prompt over NCCL and Mooncake, PD (prefill GPU 0, decode GPU 1) against two
# unified replicas, greedy equality. Expects the wheels from ../shared/tools/device-bundle
# installed (PYTHONPATH, PATH, LD_LIBRARY_PATH set) and $OUT to collect logs; the JSON lands
# in $OUT/two_gpu_pd.json (copy it to docs/data/), the plot in $OUT/two_gpu_pd.png (to docs/img/;
# without matplotlib there: python bench/two_gpu_pd.py --plot-from docs/data/two_gpu_pd.json). Every step has its own timeout;
# TWO_GPU_ARGS passes options to the bench (e.g. "--rates 4,12" for a shorter sweep).
set -u
out=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR TOKENIZERS_PARALLELISM=false
{
  timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  timeout 20 nvidia-smi topo -m
  timeout 60 python3 -c "import torch, transformers; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$out/gpu.txt"

# 1. the backend: nccl between the two GPUs, and the protocol on gloo (about 30 s)
timeout -k 10 80 python3 -m pytest -q -p no:cacheprovider tests/workers/test_p2p_transfer.py 2>&1 \
  | tee "$out/test_p2p.log" | grep -E "passed|failed|skipped|^FAILED|^E  " | head

# 2. the measurement (writes its JSON after each phase, so a cut-short run still leaves data)
timeout -k 15 430 python3 bench/two_gpu_pd.py --out "$out/two_gpu_pd.json" --img "$out/two_gpu_pd.png" ${TWO_GPU_ARGS:-} 2>&1 \
  | tee "$out/two_gpu_pd.log" | grep -v -E "^WARNING: Logging|Local segment descriptor" | tail -40

# What the systems logged, for a failure's post-mortem (the bench prints their paths).
for f in /tmp/pd-two-pd-*/pd.log /tmp/pd-two-unified-*/unified.log; do
  [ -f "$f" ] && tail -60 "$f" > "$out/$(basename "$(dirname "$f")").log"
done
ls -la "$out"

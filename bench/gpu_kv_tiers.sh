#!/usr/bin/env bash
# One H200, one call (about 5 minutes): the KV tiers on the GPU (pinned host slots, copies
# on the stream, disk snapshots behind an event) against runs without them, the tier tests
# (Mooncake Store included, with the CUDA 13 Mooncake wheel), then bench/kv_tiers.py at
# Qwen2.5-7B dimensions with random bf16 weights. Wheels: .whl/ (orjson, nats-py,
# mooncake-transfer-engine-cuda13), .deb/ (libibverbs1 and friends), as
# ../shared/tools/device-bundle fetches them.
set -u
out=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
mkdir -p /tmp/debroot && for f in .deb/*.deb; do dpkg -x "$f" /tmp/debroot; done
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH LD_LIBRARY_PATH=/tmp/debroot/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR GLOG_minloglevel=2
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py -k kv_tiers 2>&1 | tail -3
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_kv_tiers.py 2>&1 | tail -3
python3 bench/make_dummy_model.py --out /tmp/m7b >/dev/null
timeout 330 python3 bench/kv_tiers.py --device cuda --model /tmp/m7b --load-format dummy --users 4 --turns 4 \
  --answer 4 --host-bytes $((2 << 30)) --json "$out/kv_tiers_h200.json" > "$out/kv_tiers_h200.log" 2>&1
grep -v "^[IWE]1202" "$out/kv_tiers_h200.log" | grep "^none\|^host\|^disk\|^store\|Error" | cut -c1-220

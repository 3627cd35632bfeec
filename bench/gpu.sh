#!/usr/bin/env bash
# The GPU measurements, one mode a call (each under the device's ten-minute limit):
#   bash bench/gpu.sh one_gpu_pd     # bench/one_gpu_pd.py: co-located PD against unified on one GPU
#   bash bench/gpu.sh tests          # the GPU tests: kernels, graphs, sampler, the fast path against transformers
#                                    # (speculation under grammars too where xgrammar's wheels are installed)
#   bash bench/gpu.sh engine         # bench/gpu_engine.py: the engine against transformers, a profile, the e2e
#                                    # pairs (API processes: E2E_API_PROCESSES, default 2) and the worker's step timeline
#   bash bench/gpu.sh e2e            # the e2e pairs alone with the step timeline (e.g. ARGS="--e2e-waves 1")
#   bash bench/gpu.sh trace          # the engine figures alone and the prefill's Chrome trace (gzipped)
#   bash bench/gpu.sh so             # bench/structured_output.py on the 7B stand-in with py-spy, then the
#                                    # host's grammar work per step (bench/probes/grammar_host.py)
#   bash bench/gpu.sh kv_tiers       # the tier tests on the GPU, then bench/kv_tiers.py at 7B dimensions, a run per
#                                    # context length (PREFIXES, default "8192 2048 512"; logs in kv_tiers_logs.tgz)
#   bash bench/gpu.sh tiers_writes   # a first process writing its disk at 512 tokens, against fresh processes: alone
#                                    # (kv_tiers --no-chat --no-store --step-times, the OS counters, a trace of the
#                                    # third prompt) with the files on the disk, then on /dev/shm (no writeback)
#   bash bench/gpu.sh pending        # what waits for a device: the first_load probe, then the KV tiers at 512 and
#                                    # 2,048 tokens (kv_tiers, TESTS=0, --compare-warm-up)
#   bash bench/gpu.sh serve          # pdserve up (PD, then unified) on one GPU at 7B dimensions, pdserve bench at 1 and 64
#   bash bench/gpu.sh fp8            # the FP8 tests on the GPU, bench/probes/fp8_probe.py, then bench/gpu_engine.py in
#                                    # bf16 and FP8 variants in one call (gpu_engine_NAME.json; logs in fp8_logs.tgz)
#   bash bench/gpu.sh probes         # the probes in PROBES (default "diag gemv attention"; also fp32, reading, ipc,
#                                    # verify: speculative verify steps against plain decode, quant: FP8 row quantization,
#                                    # attention_fp8: the decode attention over an FP8 pool; attention_tiles: at the
#                                    # engine's launch settings, bf16 KV, FP8 KV, and FP8 KV read in float16 tiles;
#                                    # sdpa: a whole prompt's attention the first time its length is met, per backend;
#                                    # first_load: a restarted worker's first disk load against its later ones, with
#                                    # and without the start-up warm-up, 512 tokens at 7B dimensions; prefixed: a
#                                    # prompt's chunks after a prefix through the paged kernel against flash attention
#                                    # over their gathered pages, at 7B dimensions)
#   bash bench/gpu.sh two_gpu_pd     # 2 GPUs: the p2p tests, then bench/two_gpu_pd.py (NCCL KV, PD against 2 unified)
#   bash bench/gpu.sh two_tp         # 2 GPUs: the TP tests, then bench/tensor_parallel.py (TP 1 against TP 2)
#   bash bench/gpu.sh xpyd           # 4 GPUs: bench/xpyd.py, some systems a call (ARGS="--configs 2P2D,4U"; XPYD_JSON:
#                                    # a copy of the JSON so far, which the run merges its systems into)
# Expects the wheels of ../shared/tools/device-bundle installed (PYTHONPATH, PATH,
# LD_LIBRARY_PATH set; that script prints the lines); every step has a timeout and its log under $OUT.
# The modes that run pytest also need its plugins, which the bundle lacks (without them pytest
# stops at pyproject's asyncio and timeout options): first, here,
#   pip download --no-deps -d .whl pytest-asyncio pytest-timeout
# ARGS passes options to the mode's script (e.g. ARGS="--systems colocated,unified-2048").
set -u
modes=$(sed -n 's/^#   bash bench\/gpu.sh \([a-z_0-9]*\) .*/\1/p' "$0")
if [ -z "${1:-}" ] || ! grep -qxF -- "$1" <<< "$modes"; then
  [ -z "${1:-}" ] || echo "unknown mode: $1" >&2
  echo "usage: bash bench/gpu.sh MODE, one of:"
  sed -n 's/^#   bash bench\/gpu.sh /  /p; s/^#  \{20,\}/                 /p' "$0"
  [ -z "${1:-}" ] && exit 0 || exit 2
fi
out=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR TOKENIZERS_PARALLELISM=false
timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
gpu_tests=(tests/engine/test_gpu.py tests/engine/test_kernels.py tests/engine/test_sampler.py
  tests/workers/test_ipc_transfer.py
  "tests/engine/test_fast_model.py::test_fast_path_greedy_equals_transformers"
  "tests/engine/test_fast_model.py::test_prefixed_sdpa_attends_as_the_paged_prefill_kernel"
  "tests/engine/test_fast_model.py::test_long_chunks_after_a_prefix_take_the_gathered_attention_and_equal_transformers")
# structured output's GPU tests need xgrammar and jsonschema (EXTRA_WHEELS of device-bundle)
python3 -c "import xgrammar, jsonschema" 2> /dev/null && gpu_tests+=(tests/engine/test_speculative_grammar.py::test_constrained_speculation_on_a_gpu_is_the_output_without)
quiet() { grep -v -E "^WARNING: Logging|Local segment descriptor| step |Warning|DEBUG|^[IWE][0-9]{4} "; }
dummy_7b() { timeout 60 python3 bench/make_dummy_model.py --out /tmp/m7b > "$out/make_dummy_model.log" 2>&1; }
case "$1" in
one_gpu_pd)
  timeout -k 15 ${LIMIT:-540} python3 bench/one_gpu_pd.py --out "$out/one_gpu_pd.json" --log-dir "$out" ${ARGS:-} 2>&1 \
    | tee "$out/one_gpu_pd.log" | grep -v -E "^WARNING: Logging|Local segment descriptor" | tail -40
  ;;
tests)
  timeout -k 10 300 python3 -m pytest -q -p no:cacheprovider "${gpu_tests[@]}" ${ARGS:-} > "$out/test_gpu.log" 2>&1
  grep -E "passed|failed|^FAILED|^E  " "$out/test_gpu.log" | head -30
  ;;
engine)
  timeout -k 15 ${LIMIT:-420} python3 bench/gpu_engine.py --json "$out/gpu_engine.json" --profile "$out/profile.txt" --e2e \
    --e2e-api-processes ${E2E_API_PROCESSES:-2} --e2e-step-log ${ARGS:-} > "$out/gpu_engine_steps.log" 2>&1
  quiet < "$out/gpu_engine_steps.log" | tail -16
  [ -f "$out/trace_prefill.json" ] && gzip -f "$out/trace_prefill.json"; rm -f "$out/trace_decode64.json"
  timeout 60 python3 bench/probes/step_timeline.py "$out/gpu_engine_steps.log" "$out/gpu_engine.json" \
    --out "$out/gpu_engine_timeline.json" 2>&1 | tee "$out/step_timeline.log" | tail -3
  ;;
e2e)
  timeout -k 15 ${LIMIT:-300} python3 bench/gpu_engine.py --json "$out/gpu_engine_e2e.json" --only-e2e \
    --e2e-api-processes ${E2E_API_PROCESSES:-2} --e2e-step-log ${ARGS:-} > "$out/gpu_engine_e2e_steps.log" 2>&1
  quiet < "$out/gpu_engine_e2e_steps.log" | tail -6
  timeout 60 python3 bench/probes/step_timeline.py "$out/gpu_engine_e2e_steps.log" "$out/gpu_engine_e2e.json" \
    --out "$out/gpu_engine_e2e_timeline.json" 2>&1 | tee "$out/step_timeline.log" | tail -3
  ;;
trace)
  timeout -k 15 ${LIMIT:-200} python3 bench/gpu_engine.py --skip-transformers --json "$out/gpu_engine_trace_run.json" \
    --profile "$out/profile_trace_run.txt" ${ARGS:-} > "$out/gpu_engine_trace_run.log" 2>&1
  quiet < "$out/gpu_engine_trace_run.log" | tail -12
  [ -f "$out/trace_prefill.json" ] && gzip -f "$out/trace_prefill.json"; rm -f "$out/trace_decode64.json"
  ;;
so)  # needs the wheels of jsonschema, xgrammar, pydantic and py-spy (EXTRA_WHEELS of device-bundle, with their dependencies)
  dummy_7b
  timeout -k 15 ${LIMIT:-400} python3 bench/structured_output.py --model-path /tmp/m7b \
    --extra "--device cuda --load-format dummy --log-level DEBUG" --out "$out/structured_output_gpu.json" \
    --profile "$out/so_profile.txt" ${ARGS:-} > "$out/structured_output.log" 2>&1
  grep "^{\|median" "$out/structured_output.log" | cut -c1-150
  timeout -k 10 90 python3 bench/probes/grammar_host.py --out "$out/grammar_host.json" 2>&1 \
    | tee "$out/grammar_host.log" | tail -12
  ;;
kv_tiers)  # Mooncake Store included: the CUDA 13 Mooncake wheel and Debian's libibverbs (device-bundle)
  # PREFIXES: the contexts measured (a run each, the device pool 1.5 contexts: fewer than the users');
  # LIMIT: seconds a run (on an H200 on 2026-12-05: 8,192 tokens ~180 s, 2,048 ~110, 512 ~100; an H100 is slower)
  export GLOG_minloglevel=2
  if [ "${TESTS:-1}" = 1 ]; then  # TESTS=0: the runs alone
    timeout -k 10 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py -k kv_tiers \
      > "$out/test_gpu_kv_tiers.log" 2>&1; tail -3 "$out/test_gpu_kv_tiers.log"
  fi
  dummy_7b
  for prefix in ${PREFIXES:-8192 2048 512}; do
    timeout -k 15 ${LIMIT:-240} python3 bench/kv_tiers.py --device cuda --model /tmp/m7b --load-format dummy --users 4 \
      --turns ${TURNS:-3} --answer 4 --prefix "$prefix" --pool-tokens $((prefix * 3 / 2)) --host-bytes $((4 << 30)) --store-bytes $((8 << 30)) \
      --json "$out/kv_tiers_gpu_$prefix.json" ${ARGS:-} > "$out/kv_tiers_gpu_$prefix.log" 2>&1
    echo "== prefix $prefix"; quiet < "$out/kv_tiers_gpu_$prefix.log" | grep "^none\|^host\|^disk\|^store\|^all\|Error" | cut -c1-220
  done
  # its own logs only (a caller's logs in the same folder stay as they are)
  (cd "$out" && logs=$(ls kv_tiers_gpu_*.log test_gpu_kv_tiers.log make_dummy_model.log 2> /dev/null || true) \
    && [ -n "$logs" ] && tar -czf kv_tiers_logs.tgz $logs && rm -f $logs)
  ;;
tiers_writes)  # LIMIT: seconds a run (two runs; ~100 s each on an H100)
  { df -h /tmp /dev/shm; for f in dirty_ratio dirty_background_ratio dirty_expire_centisecs dirty_writeback_centisecs; do
      echo "vm.$f $(cat /proc/sys/vm/$f)"; done; } > "$out/tiers_writes_env.txt" 2>&1
  for where in disk shm; do
    extra=$([ $where = shm ] && echo "--tmp-dir /dev/shm" || true)
    OUT="$out/$where" TESTS=0 PREFIXES=512 LIMIT=${LIMIT:-100} ARGS="--step-times --no-chat --no-store $extra \
      --profile-dir $out/$where/prof --profile-prompt 2" bash "$0" kv_tiers
    timeout 20 python3 -c "import json, sys
for name, r in json.load(open(sys.argv[1]))['restart'].items():
    if isinstance(r, dict):
        print(sys.argv[2], name, r['ttft_ms_each'], [(o['minflt'], o['nvcsw'], o['nivcsw'], o['nr_dirty_before'], o['nr_writeback_before'])
              for o in r.get('os_each', [])])" "$out/$where/kv_tiers_gpu_512.json" $where
  done
  (cd "$out" && tar -czf tiers_writes.tgz disk shm tiers_writes_env.txt && rm -rf disk shm tiers_writes_env.txt)
  ;;
pending)  # LIMIT seconds a run (~100 and ~110 s on an H100); restarted and second workers with and without the warm-up
  PROBES=first_load bash "$0" probes
  TESTS=0 PREFIXES="512 2048" LIMIT=${LIMIT:-200} ARGS="--compare-warm-up ${ARGS:-}" bash "$0" kv_tiers
  ;;
serve)  # MODES (default "pd unified"), each a fresh pdserve up on port 8050 for at most SERVE_LIMIT seconds
  timeout 60 python3 bench/make_dummy_model.py --dims qwen2.5-7b --out /tmp/qwen7b > "$out/make_dummy_model.log" 2>&1
  for mode in ${MODES:-pd unified}; do
    port=8050
    timeout -k 10 ${SERVE_LIMIT:-270} python3 -m pdserve up --mode $mode --unified-workers 1 --device cuda \
      --model-path /tmp/qwen7b --load-format dummy --max-total-tokens 200000 --port $port --host 127.0.0.1 \
      --data-dir /tmp/pd-$mode > "$out/up_$mode.log" 2>&1 &
    up=$!
    for _ in $(seq 1 240); do curl -sf localhost:$port/health > /dev/null && break; sleep 1; done
    timeout 60 python3 -m pdserve bench --base-url http://127.0.0.1:$port --backend generate --tokenizer /tmp/qwen7b \
      --num-prompts 8 --max-concurrency 8 --input-len 512 --output-len 16 --quiet > "$out/warmup_$mode.log" 2>&1
    for c in 1 64; do
      n=$([ $c = 1 ] && echo 8 || echo 128)
      timeout 150 python3 -m pdserve bench --base-url http://127.0.0.1:$port --backend generate --tokenizer /tmp/qwen7b \
        --num-prompts $n --max-concurrency $c --input-len 512 --output-len 128 --output-json "$out/bench_${mode}_c$c.json" \
        > "$out/bench_${mode}_c$c.log" 2>&1
      echo "== $mode, $c in flight"; grep -E "throughput|TTFT|TPOT|queue|transfer" "$out/bench_${mode}_c$c.log"
    done
    kill -TERM $up; wait $up
  done
  ;;
fp8)  # FP8_RUNS: "name|gpu_engine flags" runs separated by ";" (default: bf16; FP8 weights; the same without fast
  # accumulation; FP8 KV alone; FP8 weights and KV)
  timeout -k 10 ${TEST_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider tests/engine/test_fp8_kernels.py \
    tests/engine/test_fp8_model.py tests/engine/test_kv_fp8.py > "$out/test_fp8.txt" 2>&1
  grep -E "passed|failed|^FAILED|^E  " "$out/test_fp8.txt" | cut -c1-300 | head -30
  timeout -k 10 ${PROBE_LIMIT:-150} python3 bench/probes/fp8_probe.py --out "$out/fp8_probe.json" \
    ${PROBE_ARGS:---rows 1,64,128,4096 --budget 120} > "$out/fp8_probe.log" 2>&1
  sed -n '/^shape /,$p' "$out/fp8_probe.log" | cut -c1-250 | tail -30
  IFS=';' read -ra runs <<< "${FP8_RUNS:-bf16|--skip-transformers;fp8|--quantization fp8 --fp8-logit-error;fp8_exact|--quantization fp8 --fp8-accum exact;fp8_kv|--skip-transformers --kv-cache-dtype fp8_e4m3;fp8_all|--quantization fp8 --kv-cache-dtype fp8_e4m3}"
  for run in "${runs[@]}"; do
    name=${run%%|*}
    timeout -k 15 ${ENGINE_LIMIT:-150} python3 bench/gpu_engine.py ${run#*|} --json "$out/gpu_engine_$name.json" ${ARGS:-} \
      > "$out/gpu_engine_$name.log" 2>&1
    echo "== $name"; quiet < "$out/gpu_engine_$name.log" | grep -v scaled_dot_product | tail -9
  done
  (cd "$out" && logs=$(ls gpu_engine_*.log fp8_probe.log test_fp8.txt 2> /dev/null || true) \
    && [ -n "$logs" ] && tar -czf fp8_logs.tgz $logs && rm -f $logs)
  ;;
probes)
  for probe in ${PROBES:-diag gemv attention}; do
    case $probe in
    diag) timeout -k 10 150 python3 bench/probes/gpu_diag.py ;;
    gemv) timeout -k 10 300 python3 bench/probes/gemv_probe.py --json "$out/gemv_probe.json" ;;
    attention) timeout -k 10 150 python3 bench/probes/attention_probe.py --json "$out/attention_probe.json" ;;
    attention_fp8) timeout -k 10 200 python3 bench/probes/attention_probe.py --kv-fp8 --json "$out/attention_probe_fp8.json" ;;
    attention_tiles)
      for kv in "bf16|" "fp8|--kv-fp8" "fp8_f16|--kv-fp8 --f16-tiles"; do
        timeout -k 5 60 python3 bench/probes/attention_probe.py --defaults ${kv#*|} --json "$out/attention_tiles_${kv%%|*}.json"
      done ;;
    fp32) timeout -k 10 240 python3 bench/probes/gpu_fp32_check.py ;;
    reading) timeout -k 10 420 python3 bench/probes/gpu_reading.py --device cuda --json "$out/gpu_reading.json" ;;
    ipc) timeout -k 10 360 python3 bench/probes/ipc_probe.py --out "$out/ipc_probe.json" ;;
    verify) timeout -k 10 300 python3 bench/probes/verify_probe.py --out "$out/verify_probe.json" ${VERIFY_ARGS:-} ;;
    quant) timeout -k 10 120 python3 bench/probes/quant_probe.py --out "$out/quant_probe.json" ;;
    rope) timeout -k 10 120 python3 bench/probes/rope_store_probe.py --out "$out/rope_store_probe.json" ;;
    sdpa) timeout -k 10 120 python3 bench/probes/sdpa_shapes_probe.py --out "$out/sdpa_shapes_probe.json" ;;
    first_load) dummy_7b; timeout -k 10 200 python3 bench/probes/first_load_probe.py --device cuda --model /tmp/m7b \
      --load-format dummy --prefix 512 --out "$out/first_load_probe_gpu.json" ;;
    prefixed) dummy_7b; timeout -k 10 200 python3 bench/probes/prefixed_probe.py --device cuda --model /tmp/m7b \
      --load-format dummy --out "$out/prefixed_probe_gpu.json" ;;
    *) echo "unknown probe: $probe (diag, gemv, attention, attention_fp8, attention_tiles, fp32, reading, ipc, verify, quant, rope, sdpa, first_load, prefixed)" ;;
    esac > "$out/probe_$probe.log" 2>&1
    echo "== $probe"; grep -v "^  " "$out/probe_$probe.log" | tail -14
  done
  ;;
two_gpu_pd)  # the JSON to docs/data/, the plot to docs/img/ (without matplotlib there: --plot-from the JSON here)
  {
    timeout 20 nvidia-smi topo -m
    timeout 60 python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
  } >> "$out/gpu.txt" 2>&1
  timeout -k 10 80 python3 -m pytest -q -p no:cacheprovider tests/workers/test_p2p_transfer.py > "$out/test_p2p.log" 2>&1
  grep -E "passed|failed|skipped|^FAILED|^E  " "$out/test_p2p.log" | head
  # writes its JSON after each phase, so a cut-short run still leaves data
  timeout -k 15 ${LIMIT:-430} python3 bench/two_gpu_pd.py --out "$out/two_gpu_pd.json" --img "$out/two_gpu_pd.png" ${ARGS:-} 2>&1 \
    | tee "$out/two_gpu_pd.log" | grep -v -E "^WARNING: Logging|Local segment descriptor" | tail -40
  for f in /tmp/pd-two-pd-*/pd.log /tmp/pd-two-unified-*/unified.log; do  # the systems' logs, for a post-mortem
    [ -f "$f" ] && tail -60 "$f" > "$out/$(basename "$(dirname "$f")").log"
  done
  ;;
two_tp)  # with CUDA graphs and, if that run fails, without (--no-graphs)
  timeout 20 nvidia-smi topo -m >> "$out/gpu.txt" 2>&1
  timeout -k 10 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_parallel.py > "$out/test_parallel.log" 2>&1
  grep -E "passed|failed|skipped|^FAILED|^E  " "$out/test_parallel.log" | head
  if timeout -k 10 240 python3 bench/tensor_parallel.py --json "$out/tensor_parallel.json" ${ARGS:-} \
    > "$out/tensor_parallel.log" 2>&1; then
    tail -8 "$out/tensor_parallel.log"
  else
    tail -30 "$out/tensor_parallel.log"
    timeout -k 10 200 python3 bench/tensor_parallel.py --no-graphs --json "$out/tensor_parallel_no_graphs.json" ${ARGS:-} \
      > "$out/tensor_parallel_no_graphs.log" 2>&1
    tail -5 "$out/tensor_parallel_no_graphs.log"
  fi
  ;;
xpyd)
  [ -n "${XPYD_JSON:-}" ] && cp "$XPYD_JSON" "$out/xpyd.json"
  timeout -k 15 ${LIMIT:-540} python3 bench/xpyd.py --out "$out/xpyd.json" --img "$out/xpyd.png" ${ARGS:-} 2>&1 \
    | tee "$out/xpyd.log" | grep -v -E "^WARNING: Logging|Local segment descriptor" | tail -40
  ;;
esac

#!/usr/bin/env bash
# One H200, two calls of under ten minutes each (the per-call limit):
#   bash bench/gpu_session11.sh engine   # the engine bench with the e2e pairs (API processes:
#                                        # $E2E_API_PROCESSES, default 2), the lean client
#                                        # (bench/sse_client.py), the worker's step timeline and the
#                                        # clients' per-request timeline; the prefill's host and
#                                        # queued device times
#   bash bench/gpu_session11.sh trace    # the engine figures alone and the prefill's Chrome trace
#   bash bench/gpu_session11.sh so       # the GPU tests, structured output's cost with its step
#                                        # timeline and py-spy's stacks of its first constrained
#                                        # round (py-spy's wheel in .whl), the host's grammar work per step
# Needs the wheels of jsonschema, xgrammar, pydantic and pytest-asyncio (with their dependencies) in .whl:
# EXTRA_WHEELS does not fetch dependencies; pip download them into .whl beside device-bundle's.
set -u
out=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR
case "${1:-engine}" in
engine)  # WITH_TESTS=1: the GPU tests first (stops if one fails)
  if [ -n "${WITH_TESTS:-}" ]; then
    timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_gpu.py tests/engine/test_kernels.py \
      "tests/engine/test_fast_model.py::test_fast_path_greedy_equals_transformers" > "$out/test_gpu.log" 2>&1 ||
      { tail -30 "$out/test_gpu.log"; exit 1; }
    tail -1 "$out/test_gpu.log"
  fi
  timeout 420 python3 bench/gpu_engine.py --json "$out/gpu_engine.json" --profile "$out/profile.txt" --e2e --try-separate-rope \
    --e2e-api-processes ${E2E_API_PROCESSES:-2} --e2e-step-log > "$out/gpu_engine_steps.log" 2>&1
  grep -v " step \|Warning\|DEBUG" "$out/gpu_engine_steps.log" | tail -16
  gzip -f "$out"/trace_prefill.json; rm -f "$out"/trace_decode64.json
  python3 bench/probes/step_timeline.py "$out/gpu_engine_steps.log" "$out/gpu_engine.json" --out "$out/gpu_engine_timeline.json" | tail -3
  ;;
so)  # SKIP_TESTS=1: without the GPU tests; SKIP_GRAMMAR_HOST=1: without bench/probes/grammar_host.py
  [ -n "${SKIP_TESTS:-}" ] || timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py tests/engine/test_kernels.py \
    "tests/engine/test_fast_model.py::test_fast_path_greedy_equals_transformers" 2>&1 | tee "$out/test_gpu.log" |
    grep -E "passed|failed|^FAILED|^E  " | head
  python3 bench/make_dummy_model.py --out /tmp/m7b >/dev/null
  timeout 400 python3 bench/structured_output.py --model-path /tmp/m7b --extra "--device cuda --load-format dummy --log-level DEBUG" \
    --out "$out/structured_output_gpu.json" --profile "$out/so_profile.txt" > "$out/structured_output.log" 2>&1
  grep "^{\|median" "$out/structured_output.log" | cut -c1-150
  [ -n "${SKIP_GRAMMAR_HOST:-}" ] || timeout 90 python3 bench/probes/grammar_host.py --out "$out/grammar_host.json" 2>&1 | tail -12
  ;;
trace)  # the engine figures without transformers or e2e, and the prefill's Chrome trace (gzipped)
  timeout 200 python3 bench/gpu_engine.py --skip-transformers --json "$out/gpu_engine_trace_run.json" \
    --profile "$out/profile_trace_run.txt" > "$out/gpu_engine_trace_run.log" 2>&1
  tail -12 "$out/gpu_engine_trace_run.log"
  gzip -f "$out"/trace_prefill.json; rm -f "$out"/trace_decode64.json
  ;;
esac

#!/usr/bin/env bash
# Issue 10's CPU-bound figures on a host with cores to spare (a GPU host's CPUs, the GPU unused),
# to separate what pdserve costs from what sharing two cores costs:
#   bash bench/probes/spare_cores.sh broker     # bench/broker_latency.py on every core, then the same pinned
#                                        # to two cores (taskset; nats-server and the consumer inherit it)
#   bash bench/probes/spare_cores.sh pipeline   # bench/pipeline_vs_offline.py on every core (CUDA hidden);
#                                        # PIPELINE_ARGS adds flags (e.g. --modes pd --repeat 5)
#   bash bench/probes/spare_cores.sh threads    # the same per mode and torch threads per worker
#                                        # (THREAD_CONFIGS="mode:n[:opts] ...", 0 = `pdserve up`'s default,
#                                        # pd:P+D = P prefill and D decode threads;
#                                        # the cores less one in eight, shared by the workers; opts,
#                                        # joined by +: pin = `up --pin-cores`, the client on the cores
#                                        # it leaves; share = `up --share-cores`, threads follow load:
#                                        # tried, not in main: `git apply docs/data/tried/share_cores.patch`)
#   bash bench/probes/spare_cores.sh probe      # bench/probes/thread_probe.py on every core
set -u
out=${OUT:-/tmp/pdserve-cores}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR CUDA_VISIBLE_DEVICES=
{ echo "date $(date -Is)"; echo "nproc $(nproc)"; grep -m1 "model name" /proc/cpuinfo; cat /proc/loadavg; } | tee "$out/host.txt"
case "${1:-broker}" in
broker)
  timeout 240 python3 bench/broker_latency.py --rounds ${ROUNDS:-200} --json "$out/broker_latency_all_cores.json" 2>&1 |
    tee "$out/broker_all_cores.log" | grep "p50"
  timeout 240 taskset -c 0,1 python3 bench/broker_latency.py --rounds ${ROUNDS:-200} \
    --json "$out/broker_latency_two_cores.json" 2>&1 | tee "$out/broker_two_cores.log" | grep "p50"
  ;;
pipeline)
  timeout 560 python3 bench/pipeline_vs_offline.py --json "$out/pipeline_vs_offline_all_cores.json" ${PIPELINE_ARGS:-} \
    > "$out/pipeline.log" 2>&1
  grep -v "^ \|^{\|^}" "$out/pipeline.log" | tail -12
  ;;
threads)
  i=0
  for cfg in ${THREAD_CONFIGS:-unified:0 unified:12 unified:8 pd:0 pd:6 pd:4}; do
    IFS=: read -r mode n opts <<< "$cfg"
    up=""; [ "$n" = 0 ] || up="--num-threads $n"
    case $n in *+*) up="--prefill-num-threads ${n%+*} --decode-num-threads ${n#*+}" ;; esac
    for o in ${opts//+/ }; do up="$up --$o-cores"; done
    name="$((i += 1))_${mode}_threads${n/+/_}${opts:+_${opts//+/_}}"
    timeout 170 python3 bench/pipeline_vs_offline.py --modes $mode --up-args "$up" \
      --json "$out/pipeline_vs_offline_$name.json" > "$out/pipeline_$name.log" 2>&1
    echo "== $mode, worker threads ${n/#0/default}${opts:+, $opts}"; grep "offline .* pipeline\|cold\|rror" "$out/pipeline_$name.log" | tail -5
  done
  ;;
probe)   # bench/probes/thread_probe.py: where the engine is built and stepped, each way in its own process
  timeout 500 python3 bench/probes/thread_probe.py --repeat ${REPEAT:-3} --json "$out/thread_probe.json" 2>&1 | tee "$out/thread_probe.log"
  ;;
esac
# one archive: the device tool brings back a limited number of files
tar czf "/tmp/spare_cores_$1.tgz" -C "$out" . && rm -rf "${out:?}"/* && mv "/tmp/spare_cores_$1.tgz" "$out/"
cat /proc/loadavg

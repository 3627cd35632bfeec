cd /work/main
echo "== plain"; timeout 500 .venv/bin/python bench/pipeline_vs_offline.py --modes unified --repeat 3 --json /tmp/nice_plain2.json 2>&1 | grep "offline .*pipeline\|cold"
(while true; do for p in $(pgrep -f "pdserve up --mode|nats-server"); do renice -n 10 -p $p >/dev/null 2>&1; done; sleep 1; done) & RP=$!
echo "== nice"; timeout 500 .venv/bin/python bench/pipeline_vs_offline.py --modes unified --repeat 3 --json /tmp/nice_api2.json 2>&1 | grep "offline .*pipeline\|cold"; kill $RP

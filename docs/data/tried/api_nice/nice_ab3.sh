cd /work/main
for i in 3 4 5; do
echo "== plain $i"; timeout 500 .venv/bin/python bench/pipeline_vs_offline.py --modes unified --repeat 3 --json /tmp/nice_plain$i.json 2>&1 | grep "cold pipe"
(while true; do for p in $(pgrep -f "pdserve up --mode|nats-server"); do renice -n 10 -p $p >/dev/null 2>&1; done; sleep 1; done) & RP=$!
echo "== nice $i"; timeout 500 .venv/bin/python bench/pipeline_vs_offline.py --modes unified --repeat 3 --json /tmp/nice_api$i.json 2>&1 | grep "cold pipe"; kill $RP
done

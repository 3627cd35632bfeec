# A/B on the device host's CPUs: after (this tree) vs before (.ab_before), alternating
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR CUDA_VISIBLE_DEVICES=
root=$PWD; out=$1; mkdir -p $out
rm -rf /tmp/before_tree && mkdir -p /tmp/before_tree && tar --exclude=./.whl --exclude=./.deb --exclude=./.git -cf - . | tar -xf - -C /tmp/before_tree; cp -r $root/.ab_before/* /tmp/before_tree/; grep -c CallerThreadExecutor /tmp/before_tree/pdserve/launch.py $root/pdserve/launch.py
{ date -Is; nproc; cat /proc/loadavg; } > $out/host.txt
for spec in unified:after unified:before pd:after pd:before unified:after unified:before; do
  mode=${spec%%:*} tree=${spec##*:}
  if [ $tree = before ]; then cd /tmp/before_tree; export PYTHONPATH=/tmp/before_tree:/tmp/site; else cd $root; export PYTHONPATH=$root:/tmp/site; fi
  n=$(ls $out | grep -c "${mode}_${tree}")
  timeout 100 python3 bench/pipeline_vs_offline.py --modes $mode --repeat 2 --json $out/${mode}_${tree}_$n.json > $out/${mode}_${tree}_$n.log 2>&1
  echo "== $mode $tree: $(grep 'offline .*pipeline\|cold pipe' $out/${mode}_${tree}_$n.log | tr '\n' ' ')"
done
cd $root; tar czf /tmp/ab.tgz -C $out . && rm -rf $out/* && mv /tmp/ab.tgz $out/

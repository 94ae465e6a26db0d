# call 2 (same machine, right after call 1): the rest of the KernelBench-style eval phase, then ours cold on the
# same 48, alternating workers forked from the fork server (runs 1, 3, 5) and started as interpreters (2, 4);
# everything comes back as one archive (a call returns at most 8 files)
source .devcarry/setup.sh
mkdir -p /tmp/c2
timeout 200 python3 benchmarks/eval_throughput.py --data .devcarry/shared/data --evaluators kb --kb-subset 48 \
   --jobs 16 --kb-build-root /tmp/kb --kb-resume /tmp/kb1.json --out /tmp/c2/tp_kb.json > /tmp/c2/kb2.log 2>&1
echo "kb rc=$?"; grep -v "^kb pre-compile" /tmp/c2/kb2.log | tail -20
for run in 1 2 3 4 5; do
  if [ $((run % 2)) -eq 1 ]; then how=fork; flag=--fork-workers; else how=nofork; flag=--no-fork-workers; fi
  [ "$(left)" -gt 95 ] || { echo "run $run skipped: $(left) s left"; break; }
  timeout $(( $(left) - 10 )) python3 benchmarks/eval_throughput.py --data .devcarry/shared/data --evaluators ours \
     --kb-subset 48 --jobs 16 $flag --out /tmp/c2/ab_${run}_${how}.json > /tmp/c2/ab_${run}_${how}.log 2>&1
  echo "run $run $how rc=$?"; grep -E "cand/min|wall" /tmp/c2/ab_${run}_${how}.log | tail -3
done
tar czf $OUT/call2.tar.gz -C /tmp c2

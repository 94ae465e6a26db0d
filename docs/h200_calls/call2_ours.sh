# call 2 (same machine, right after call 1): ours cold three times on the same 48, then the full batch cold and warm
source .devcarry/setup.sh
for run in 1 2 3; do
  [ "$(left)" -gt 90 ] || { echo "run $run skipped: $(left) s left"; break; }
  timeout $(( $(left) - 10 )) python3 benchmarks/eval_throughput.py --data .devcarry/shared/data --evaluators ours \
     --tasks 4 --per-task 12 --kb-subset 48 --out $OUT/ours_$run.json > /tmp/ours_$run.log 2>&1
  echo "run $run rc=$?"; grep -E "│ ours|fork server" /tmp/ours_$run.log | head -3
done
[ "$(left)" -gt 200 ] || { echo "full batch skipped: $(left) s left"; exit 0; }
timeout $(( $(left) - 5 )) python3 benchmarks/eval_throughput.py --data .devcarry/shared/data --evaluators ours \
   --tasks 8 --per-task 12 --kb-subset 96 --warm --out $OUT/tp_full.json > /tmp/tp_full.log 2>&1
echo "rc=$?"; grep -E "│ ours|fork server" /tmp/tp_full.log | head -4

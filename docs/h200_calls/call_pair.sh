# One machine, one call: ours cold on the 4-task batch's 48 candidates (defaults), then the KernelBench-style side
# on the same 48 (about 450 s) in the time left; merge them on the development machine.
source .devcarry/setup.sh
machine $OUT/machine.txt
timeout 120 python3 benchmarks/eval_throughput.py --data .devcarry/shared/data --evaluators ours --tasks 4 \
   --per-task 12 --kb-subset 48 --out $OUT/ours_1.json > $OUT/ours_1.log 2>&1
echo "ours rc=$?"; grep -E "│ ours|fork server" $OUT/ours_1.log | head -3
timeout $(( $(left) - 3 )) python3 benchmarks/eval_throughput.py --data .devcarry/shared/data --evaluators kb \
   --tasks 4 --per-task 12 --kb-subset 48 --jobs 16 --time-budget-s $(( $(left) - 12 )) --out $OUT/tp_kb.json \
   > $OUT/tp_kb.log 2>&1
echo "kb rc=$?"; grep -v "^kb pre-compile" $OUT/tp_kb.log | tail -12

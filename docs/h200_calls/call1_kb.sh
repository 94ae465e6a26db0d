# call 1: the KernelBench-style side on the 4-task batch's 48 candidates (about 450 s)
source .devcarry/setup.sh
machine $OUT/machine.txt
timeout 585 python3 benchmarks/eval_throughput.py --data .devcarry/shared/data --evaluators kb --tasks 4 \
   --per-task 12 --kb-subset 48 --jobs 16 --time-budget-s 555 --out $OUT/tp_kb.json > $OUT/tp_kb.log 2>&1
echo "rc=$?"; grep -v "^kb pre-compile" $OUT/tp_kb.log | tail -30

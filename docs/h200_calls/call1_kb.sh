# call 1: the KernelBench-style side on the first 48 candidates, as much as fits; its builds stay in /tmp/kb
source .devcarry/setup.sh
machine $OUT/machine.txt
rm -rf /tmp/kb
timeout 585 python3 benchmarks/eval_throughput.py --data .devcarry/shared/data --evaluators kb --kb-subset 48 \
   --jobs 16 --kb-build-root /tmp/kb --time-budget-s 555 --out /tmp/kb1.json > /tmp/kb1.log 2>&1
echo "rc=$?"; cp /tmp/kb1.json /tmp/kb1.log $OUT/
grep -v "^kb pre-compile" /tmp/kb1.log | tail -30

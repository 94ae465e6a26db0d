# call 2 (same machine): the rest of the KernelBench-style eval phase, then ours cold x3 on the 48 and the full batch
source .devcarry/setup.sh
timeout 200 python3 benchmarks/eval_throughput.py --data .devcarry/shared/data --evaluators kb --kb-subset 48 \
   --jobs 16 --kb-build-root /tmp/kb --kb-resume /tmp/kb1.json --out $OUT/tp_kb.json > /tmp/kb2.log 2>&1
echo "rc=$?"; cp /tmp/kb2.log $OUT/; grep -v "^kb pre-compile" /tmp/kb2.log | tail -25
timeout $(( $(left) - 5 )) python3 benchmarks/eval_throughput.py --data .devcarry/shared/data --evaluators ours \
   --kb-subset 48 --jobs 16 --cold-repeats 3 --warm --out $OUT/tp_ours.json > /tmp/ours.log 2>&1
echo "rc=$?"; grep -v "^ours " /tmp/ours.log | tail -60

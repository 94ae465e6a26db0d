# call 3: the harness's GPU tests, the rest of the GPU suite, then ours on the full batch, cold then warm
source .devcarry/setup.sh
timeout 240 python3 -m pytest -q -rs -m gpu tests/test_harness_gpu.py tests/test_build_speed.py 2>&1 | tee $OUT/pytest_gpu_harness_$COMMIT.txt | tail -15
timeout 200 python3 -m pytest -q -rs -m gpu tests/ --deselect tests/test_harness_gpu.py --deselect tests/test_build_speed.py 2>&1 | tee $OUT/pytest_gpu_rest_$COMMIT.txt | tail -15
[ "$(left)" -gt 160 ] || { echo "full batch skipped: $(left) s left"; exit 0; }
timeout $(( $(left) - 5 )) python3 benchmarks/eval_throughput.py --data .devcarry/shared/data --evaluators ours \
   --tasks 8 --per-task 12 --kb-subset 96 --jobs 16 --warm --out $OUT/tp_full.json > $OUT/tp_full.log 2>&1
echo "rc=$?"; grep -v "^ours " $OUT/tp_full.log | tail -30

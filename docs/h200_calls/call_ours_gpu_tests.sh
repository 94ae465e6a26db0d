# The harness's GPU tests, then ours cold twice more on the 4-task batch's 48 (defaults), then the rest of the GPU
# suite in the time left (LIMIT=<seconds> when the session has less than a whole call left)
source .devcarry/setup.sh
timeout 240 python3 -m pytest -q -rs -m gpu tests/test_harness_gpu.py tests/test_build_speed.py 2>&1 | tee $OUT/pytest_gpu_harness_$COMMIT.txt | tail -6
for run in 2 3; do
  [ "$(left)" -gt 80 ] || { echo "ours $run skipped: $(left) s left"; break; }
  timeout 120 python3 benchmarks/eval_throughput.py --data .devcarry/shared/data --evaluators ours --tasks 4 \
     --per-task 12 --kb-subset 48 --out $OUT/ours_$run.json > /tmp/ours_$run.log 2>&1
  echo "ours $run rc=$?"; grep -E "│ ours|fork server" /tmp/ours_$run.log | head -3
done
[ "$(left)" -gt 30 ] || exit 0
timeout $(( $(left) - 5 )) python3 -m pytest -q -rs -m gpu tests/ --deselect tests/test_harness_gpu.py --deselect tests/test_build_speed.py 2>&1 | tee $OUT/pytest_gpu_rest_$COMMIT.txt | tail -8

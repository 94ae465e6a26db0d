# call 3: ours cold on a 48-candidate batch, forked workers and not, alternating, with the harness's GPU tests
# between the pairs; a run starts only while the call has time for it
source .devcarry/setup.sh
ab() {  # ab RUN fork|nofork
  [ "$(left)" -gt 100 ] || { echo "run $1 skipped: $(left) s left"; return; }
  timeout $(( $(left) - 10 )) python3 benchmarks/eval_throughput.py --data .devcarry/shared/data --evaluators ours \
     --tasks 4 --per-task 12 --kb-subset 48 --jobs 16 --$([ "$2" = fork ] || echo no-)fork-workers \
     --out $OUT/ab_$1_$2.json > /tmp/ab_$1_$2.log 2>&1
  echo "run $1 $2 rc=$?"; grep -E "│ ours|fork server" /tmp/ab_$1_$2.log | head -3
}
ab 1 fork; ab 2 nofork
timeout 240 python3 -m pytest -q -rs -m gpu tests/test_harness_gpu.py tests/test_build_speed.py 2>&1 | tee $OUT/pytest_gpu_harness_$COMMIT.txt | tail -6
ab 3 fork; ab 4 nofork

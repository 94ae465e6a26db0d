# Sixteenth session, call 1: the whole GPU suite at the working tree, then one cold run of ours each for the
# working tree and the commit in .devcarry/old (OLD=<commit> bash docs/h200_calls/prepare.sh), new first.
# The batch: 4 DICE tasks x 12 candidates (20 builds), the KernelBench-style call's 48. Call 3, on the same machine
# right after call1_kb.sh: NO_TESTS=1 RUNS="new_2 old_2 new_3" bash .devcarry/call_s16_tests_ab.sh
source .devcarry/setup.sh
machine $OUT/machine.txt
[ -n "${NO_TESTS:-}" ] || timeout 120 python3 benchmarks/profiler_startup.py --rounds 1 --out $OUT/profiler_startup.json 2>&1 | tail -14
[ -n "${NO_TESTS:-}" ] || timeout 300 python3 -m pytest -q -rs -m gpu tests/ 2>&1 | tee $OUT/pytest_gpu_$COMMIT.txt | tail -8
ab() {  # label, then the benchmark's script
  [ "$(left)" -gt 85 ] || { echo "$1 skipped: $(left) s left"; return; }
  timeout $(( $(left) - 5 )) python3 "$2" --data .devcarry/shared/data --evaluators ours --tasks 4 \
     --per-task 12 --kb-subset 48 --out $OUT/ours_$1.json > /tmp/$1.log 2>&1
  echo "$1 rc=$? $(grep -E '│ ours' /tmp/$1.log | head -1)"; grep -h "without the fork server" /tmp/$1.log
}
for label in ${RUNS:-new_1 old_1}; do
  case $label in
    old*) PYTHONPATH="$PWD/.devcarry/old/src" ab "$label" .devcarry/old/benchmarks/eval_throughput.py ;;
    *) ab "$label" benchmarks/eval_throughput.py ;;
  esac
done

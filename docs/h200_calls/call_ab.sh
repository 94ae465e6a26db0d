# A/B on one machine, each run cold (fresh build cache, header included), alternating: the commit before this
# session's changes (.devcarry/old, from prepare.sh with OLD=<commit>) against the working tree, at 16 and 20 builds
# in flight and 4 or 8 run workers. The batch: 4 DICE tasks x 12 candidates (20 builds).
source .devcarry/setup.sh
machine $OUT/machine.txt
ab() {  # label, then the benchmark's script and its extra flags
  local label=$1 script=$2; shift 2
  [ "$(left)" -gt 85 ] || { echo "$label skipped: $(left) s left"; return; }
  timeout $(( $(left) - 5 )) python3 "$script" --data .devcarry/shared/data --evaluators ours --tasks 4 \
     --per-task 12 --kb-subset 48 --jobs 16 "$@" --out $OUT/ab_$label.json > /tmp/$label.log 2>&1
  echo "$label rc=$? $(grep -E '│ ours' /tmp/$label.log | head -1)"; grep -h "without the fork server" /tmp/$label.log
}
old() { PYTHONPATH="$PWD/.devcarry/old/src" ab "$1" .devcarry/old/benchmarks/eval_throughput.py; }
new() { local label=$1; shift; ab "$label" benchmarks/eval_throughput.py "$@"; }
old 1_old_j16
new 2_new_j16
new 3_new_j20 --build-jobs 20
new 4_new_j20_rw8 --build-jobs 20 --run-workers 8
old 5_old_j16
new 6_new_j16
new 7_new_j20 --build-jobs 20
new 8_new_j20_rw8 --build-jobs 20 --run-workers 8

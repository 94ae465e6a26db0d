#!/usr/bin/env bash
# The GPU suite: every GPU test, then the GPU benchmarks, each step's output into one results folder.
#
#   bash benchmarks/gpu_suite.sh [RESULTS_DIR]          # default: gpu-results-<commit>-<date>
#
# Needs a CUDA GPU, torch with CUDA, nvcc, and `pip install -e '.[dev]'` (or src/ on PYTHONPATH). The corpora
# benchmarks need ../shared/data (DICE pairs, KernelBench); without it they are skipped and the log says so.
# Each step has its own time limit and writes as it goes, so a step that fails or runs out leaves the others'
# results. STEP_LIMIT_S bounds each step (default 1800); SKIP="tests throughput" skips steps by name.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
results=${1:-gpu-results-$commit-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$results"
limit=${STEP_LIMIT_S:-1800}
data=../shared/data

{ echo "commit $commit"; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  echo "cores $(nproc)"; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  nvcc --version | tail -1; } > "$results/machine.txt" 2>&1

step() {  # name, then the command; its output goes to $results/<name>.log
  local name=$1; shift
  case " ${SKIP:-} " in *" $name "*) echo "$name: skipped (SKIP)"; return;; esac
  local t0=$SECONDS
  timeout "$limit" "$@" > "$results/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - t0)) s ($results/$name.log)"
}
needs_data() { [ -d "$data" ] || { echo "$1: skipped ($data not found)"; return 1; }; }

step tests python3 -m pytest -q -rs -m gpu tests/ --junitxml="$results/tests.xml"
step examples python3 -m dice_kernels eval --example --backend cuda --out "$results/examples" --no-progress
step profiler_startup python3 benchmarks/profiler_startup.py --rounds 1 --out "$results/profiler_startup.json"
step decode_throughput python3 benchmarks/decode_throughput.py --out "$results/decode_throughput.json"
step sft_step python3 benchmarks/sft_step.py --out "$results/sft_step.json"
needs_data throughput && step throughput python3 benchmarks/eval_throughput.py --data "$data" \
    --evaluators ours --tasks 4 --per-task 12 --kb-subset 48 --out "$results/eval_throughput.json"
needs_data timing_stability && step timing_stability python3 benchmarks/timing_stability.py \
    --pairs "$data/corpora/dice_infill_eval_99.json" --try-pairs 26 --concurrency 4 --out "$results/timing_stability.json"
echo "results in $results/"

# Run on the development machine before the device calls: copies these scripts and the shared data they read
# into the git-ignored .devcarry/ (carry it), and records the commit they run at.
set -e
cd "$(dirname "$0")/../.."
rm -f .devcarry/*.sh .devcarry/*.py
mkdir -p .devcarry/shared/data/corpora
cp docs/h200_calls/*.sh docs/h200_calls/*.py .devcarry/
cp ../shared/data/corpora/dice_infill_eval_99.json .devcarry/shared/data/corpora/
cp -r ../shared/data/kernelbench .devcarry/shared/data/
git rev-parse --short HEAD > .devcarry/commit.txt
if [ -n "${OLD:-}" ]; then  # call_ab.sh's baseline: that commit's package and benchmarks
  rm -rf .devcarry/old && mkdir -p .devcarry/old
  git archive "$OLD" src benchmarks | tar -x -C .devcarry/old
fi

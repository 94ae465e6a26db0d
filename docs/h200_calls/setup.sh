# sourced by every device script: the package from src/, the shared data beside the repo, unbuffered output
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
[ -e ../shared ] || ln -s "$PWD/.devcarry/shared" ../shared
COMMIT=$(cat .devcarry/commit.txt)
T0=$(date +%s)
left() { echo $(( ${LIMIT:-590} - ($(date +%s) - T0) )); }
machine() {
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; echo "nproc $(nproc)";
    python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'; echo "commit $COMMIT";
    lscpu | grep -E "Model name|Thread|Core|Socket"; gcc --version | head -1; } > "$1" 2>&1
}

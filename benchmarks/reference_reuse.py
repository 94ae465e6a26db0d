"""Kept reference outputs (harness/process/reference_cache.py), side by side: the second batch of the same tasks,
each with a new program, evaluated with `reuse_verdicts` (the references the first batch kept in memory stand in) and
without (every reference runs again in a worker), as a demo's benchmarks and the RL reward meet the same tasks
again.

    python benchmarks/reference_reuse.py [--tasks 8] [--rounds 3] [--timed] [--out reference_reuse.json]
    python benchmarks/reference_reuse.py --smoke [--cache-dir DIR]     # CPU, the two examples, one round

The tasks are the demo world's first held-out ones (seed 0); the first batch gives each its fused C++ solution,
the second its op-by-op one (another program, so no kept verdict answers it). Builds are cached by a first,
unmeasured pass. Each round takes a new seed (part of the key: nothing an earlier round or run kept is found) and
evaluates both batches in a fresh evaluator per arm, arms in turn; it reports the second batch's wall time and the
`reference` seconds its results record, per arm. Untimed as the demo's validation and learning-curve benchmarks
(--timed: with timing, max_s 1.0, as its final benchmarks). --smoke: the package's ReLU and AddMul example tasks,
each with a PyTorch-only program, then another (nothing to build: the script's path, not its figure).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from dice_kernels.demo.world import HELDOUT, SLOW, WorldSizes, build_world, solutions
from dice_kernels.harness import EvalConfig, Evaluator, TimingConfig, candidate_from_text
from dice_kernels.tasks import load_task_file, task_from_code

EXAMPLES = Path(__file__).resolve().parents[1] / "src" / "dice_kernels" / "examples"
# --smoke: per example task, two PyTorch-only ModelNew (the robust check calls both deceptive, with or without kept
# references); AddMul's takes the task's init arguments and draws its scale as the task's Model does
SMOKE = {"19_ReLU": ("", ("torch.relu(x)", "x.clamp(min=0)"), "x"),
         "90_AddMul": ("features", ("(a * b + c) * self.scale", "torch.addcmul(c, a, b) * self.scale"), "a, b, c")}
ARMS = {"kept references (reuse_verdicts)": True, "references run again": False}


def world_batches(n: int) -> tuple[list, list]:
    """(first batch, second batch): the demo world's first `n` held-out tasks with their fused C++ solution, then
    with their op-by-op one."""
    world = [t for t in build_world(0, WorldSizes(n_train=200, n_heldout=n)) if t.split == HELDOUT][:n]
    tasks = [task_from_code(t.reference, id=t.id, name=t.name, level=t.level) for t in world]
    first = [(task, candidate_from_text(t.cpu, id=f"{t.id}/fast")) for task, t in zip(tasks, world)]
    second = [(task, candidate_from_text(solutions(t.spec, SLOW)[0], id=f"{t.id}/slow")) for task, t in zip(tasks, world)]
    return first, second


def example_batches() -> tuple[list, list]:
    """--smoke: each example task with one PyTorch-only program, then another."""
    batches: tuple[list, list] = ([], [])
    for name, (init, forwards, args) in SMOKE.items():
        task = load_task_file(EXAMPLES / "tasks" / "level1" / f"{name}.py")
        scale = "        self.scale = nn.Parameter(torch.randn(features))\n" if init else "        pass\n"
        for k, (batch, forward) in enumerate(zip(batches, forwards)):
            code = (f"import torch\nimport torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n"
                    f"    def __init__(self{', ' + init if init else ''}):\n        super().__init__()\n{scale}\n"
                    f"    def forward(self, {args}):\n        return {forward}\n")
            batch.append((task, candidate_from_text(code, id=f"{name}/{k}")))
    return batches


def second_batch(config: EvalConfig, first: list, second: list) -> dict:
    """Evaluate `first`, then time `second` on the same evaluator (its workers warm): its wall time, the reference
    seconds its results record, how many of its tasks reused a kept reference, and its outcomes."""
    with Evaluator(config) as ev:
        ev.evaluate(first)
        start = time.perf_counter()
        results = ev.evaluate(second)
        wall = time.perf_counter() - start
    return {"wall_s": round(wall, 2),
            "reference_s": round(sum(r.phases.seconds.get("reference", 0.0) for r in results), 2),
            "reused": len({r.task_id for r in results if r.reference and r.reference.reused_from}),
            "outcomes": sorted(r.outcome.value for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timed", action="store_true")
    ap.add_argument("--cache-dir", type=Path, default=None, help="build cache (default: a fresh one)")
    ap.add_argument("--out", type=Path, default=Path("reference_reuse.json"))
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    first, second = example_batches() if args.smoke else world_batches(args.tasks)
    rounds = 1 if args.smoke else args.rounds
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="dice-refreuse-"))
    timing = TimingConfig(enabled=args.timed, max_s=1.0)
    base = EvalConfig(backend="cpu", cache_dir=cache, timing=timing)
    with Evaluator(base) as ev:  # the builds, unmeasured
        ev.evaluate(first + second)
    seeds = random.Random().sample(range(1 << 30), rounds)  # new every run: the key holds the seed
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for k, seed in enumerate(seeds):
        arms = list(ARMS) if k % 2 == 0 else list(reversed(ARMS))  # in turn: neither always runs second
        for arm in arms:
            runs[arm].append(second_batch(replace(base, seed=seed, reuse_verdicts=ARMS[arm]), first, second))
            print(f"round {k + 1} {arm}: {runs[arm][-1]}", flush=True)
    outcomes = {arm: rs[0]["outcomes"] for arm, rs in runs.items()}
    assert len({json.dumps(o) for o in outcomes.values()}) == 1, outcomes  # the same verdicts either way
    summary = {arm: {"median_wall_s": statistics.median(r["wall_s"] for r in rs),
                     "median_reference_s": statistics.median(r["reference_s"] for r in rs),
                     "reused_tasks": rs[0]["reused"]} for arm, rs in runs.items()}
    doc = {"tasks": len({t.id for t, _ in second}), "candidates": len(second), "rounds": rounds,
           "timed": args.timed, "summary": summary, "runs": runs}
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"\nsecond batch of {doc['candidates']} new programs on {doc['tasks']} tasks, median of {rounds} round(s):")
    print("| arm | wall s | reference s (summed) | tasks reusing a kept reference |\n|---|---|---|---|")
    for arm, s in summary.items():
        print(f"| {arm} | {s['median_wall_s']:.2f} | {s['median_reference_s']:.2f} | {s['reused_tasks']} |")


if __name__ == "__main__":
    main()

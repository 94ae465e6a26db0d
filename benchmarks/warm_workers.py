"""How workers start, side by side on one batch with a warm build cache: on demand, started ahead of their job,
and started ahead by forking them from the fork server (the default).

    python benchmarks/warm_workers.py [--backend cpu|cuda] [--rounds 3] [--out warm_workers.json]
    python benchmarks/warm_workers.py --smoke [--cache-dir DIR]     # CPU, one round: does it run

The batch is the package's example set for the backend (builds cached by a first, unmeasured pass). Each round
evaluates it once per setting, in turn, and reports the batch wall time, the median `run` phase (candidate
worker wall time, see docs/harness.md) and the CPU seconds of the whole pass (this process and every process
under it) per setting. --cache-dir reuses a build cache (the first pass then fills nothing); --smoke is one round on the
CPU backend of ReLU's correct and wrong examples, timed in short loops (at most 0.3 s a model).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

from dice_kernels.harness import EvalConfig, SchedulerConfig, TimingConfig, evaluate
from dice_kernels.harness.candidate import pair_solutions
from dice_kernels.tasks import load_tasks

EXAMPLES = Path(__file__).resolve().parents[1] / "src" / "dice_kernels" / "examples"


def example_pairs(backend: str) -> list:
    pairs, _ = pair_solutions(load_tasks(EXAMPLES / "tasks"), EXAMPLES / "solutions" / backend)
    return pairs


SMOKE = ("level1/19_ReLU/correct.py", "level1/19_ReLU/wrong.py")  # --smoke's candidates: two builds, two runs
SETTINGS = {"on demand": SchedulerConfig(warm_workers=0, fork_workers=False),
            "started ahead": SchedulerConfig(warm_workers=-1, fork_workers=False),
            "forked ahead (default)": SchedulerConfig(warm_workers=-1, fork_workers=True)}


def _cpu_s() -> float:
    """CPU seconds of this process and of every finished process under it (each reaped by its parent)."""
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def one_pass(pairs: list, cache: Path, backend: str, setting: SchedulerConfig,
             timing: TimingConfig = TimingConfig()) -> dict:
    config = EvalConfig(backend=backend, cache_dir=cache, scheduler=setting, timing=timing)
    start, cpu = time.monotonic(), _cpu_s()
    results = evaluate(pairs, config, progress=False)
    wall, cpu = time.monotonic() - start, _cpu_s() - cpu
    runs = [r.phases.seconds["run"] for r in results if "run" in r.phases.seconds]
    return {"wall_s": wall, "cpu_s": cpu, "median_run_s": statistics.median(runs) if runs else None,
            "outcomes": {r.candidate_id: r.outcome.value for r in results}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--cache-dir", type=Path, default=None, help="a build cache to use (default: a fresh one)")
    ap.add_argument("--smoke", action="store_true", help="one round, two candidates, CPU backend: a check that it runs")
    args = ap.parse_args()
    if args.smoke:
        args.backend, args.rounds = "cpu", 1
    pairs = example_pairs(args.backend)
    if args.smoke:
        pairs = [p for p in pairs if p[1].id in SMOKE]
    # --smoke: the correct candidate is still timed (the same phases), in a short loop: up to the default 2 s a
    # model, with the reference's, was most of each of the smoke's four passes
    timing = TimingConfig(iters=5, max_s=0.3) if args.smoke else TimingConfig()
    with tempfile.TemporaryDirectory(prefix="dice-warm-") as tmp:
        cache = args.cache_dir or Path(tmp)
        one_pass(pairs, cache, args.backend, SETTINGS["on demand"], timing)  # fills the build cache; not measured
        rows: dict[str, list[dict]] = {name: [] for name in SETTINGS}
        for _ in range(args.rounds):
            for name, setting in SETTINGS.items():
                rows[name].append(one_pass(pairs, cache, args.backend, setting, timing))
    print(f"{len(pairs)} candidates, backend {args.backend}, {args.rounds} rounds of each in turn, warm build cache")
    print(f"{'workers':<24} {'median batch wall s':>20} {'median run phase s':>19} {'median CPU s':>13}")
    summary = {}
    for name, passes in rows.items():
        wall = statistics.median(p["wall_s"] for p in passes)
        run = statistics.median(p["median_run_s"] for p in passes)
        cpu = statistics.median(p["cpu_s"] for p in passes)
        summary[name] = {"median_wall_s": wall, "median_run_s": run, "median_cpu_s": cpu, "passes": passes}
        print(f"{name:<24} {wall:>20.2f} {run:>19.2f} {cpu:>13.1f}")
    same = len({json.dumps(p["outcomes"], sort_keys=True) for ps in rows.values() for p in ps}) == 1
    print(f"identical outcomes in every pass: {same}")
    if args.out:
        Path(args.out).write_text(json.dumps({"backend": args.backend, "candidates": len(pairs),
                                              "identical_outcomes": same, "settings": summary}, indent=1))


if __name__ == "__main__":
    main()

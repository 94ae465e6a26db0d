"""Workers started ahead of their job vs started on demand, side by side on one batch with a warm build cache.

    python benchmarks/warm_workers.py [--backend cpu|cuda] [--rounds 3] [--out warm_workers.json]

The batch is the package's example set for the backend (builds cached by a first, unmeasured pass). Each round
evaluates it once with `warm_workers=0` and once with the default, alternating, and reports the batch wall time
and the median `run` phase (candidate worker wall time, see docs/harness.md) per setting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from dice_kernels.harness import EvalConfig, evaluate
from dice_kernels.harness.candidate import pair_solutions
from dice_kernels.tasks import load_tasks

EXAMPLES = Path(__file__).resolve().parents[1] / "src" / "dice_kernels" / "examples"


def example_pairs(backend: str) -> list:
    pairs, _ = pair_solutions(load_tasks(EXAMPLES / "tasks"), EXAMPLES / "solutions" / backend)
    return pairs


def one_pass(pairs: list, cache: Path, backend: str, warm_workers: int) -> dict:
    config = EvalConfig(backend=backend, cache_dir=cache, warm_workers=warm_workers)
    start = time.monotonic()
    results = evaluate(pairs, config, progress=False)
    wall = time.monotonic() - start
    runs = [r.extra["phase_s"]["run"] for r in results if "run" in r.extra.get("phase_s", {})]
    return {"wall_s": wall, "median_run_s": statistics.median(runs) if runs else None,
            "outcomes": {r.candidate_id: r.outcome.value for r in results}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    pairs = example_pairs(args.backend)
    with tempfile.TemporaryDirectory(prefix="dice-warm-") as tmp:
        cache = Path(tmp)
        one_pass(pairs, cache, args.backend, 0)  # fills the build cache; not measured
        rows: dict[str, list[dict]] = {"on demand (warm_workers=0)": [], "started ahead (default)": []}
        for _ in range(args.rounds):
            rows["on demand (warm_workers=0)"].append(one_pass(pairs, cache, args.backend, 0))
            rows["started ahead (default)"].append(one_pass(pairs, cache, args.backend, -1))
    print(f"{len(pairs)} candidates, backend {args.backend}, {args.rounds} alternating rounds, warm build cache")
    print(f"{'workers':<28} {'median batch wall s':>20} {'median run phase s':>20}")
    summary = {}
    for name, passes in rows.items():
        wall = statistics.median(p["wall_s"] for p in passes)
        run = statistics.median(p["median_run_s"] for p in passes)
        summary[name] = {"median_wall_s": wall, "median_run_s": run, "passes": passes}
        print(f"{name:<28} {wall:>20.2f} {run:>20.2f}")
    same = len({json.dumps(p["outcomes"], sort_keys=True) for ps in rows.values() for p in ps}) == 1
    print(f"identical outcomes in every pass: {same}")
    if args.out:
        Path(args.out).write_text(json.dumps({"backend": args.backend, "candidates": len(pairs),
                                              "identical_outcomes": same, "settings": summary}, indent=1))


if __name__ == "__main__":
    main()

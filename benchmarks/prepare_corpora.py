"""Turn the shared real corpora into `dice eval` inputs: a tasks JSONL plus a solutions directory per corpus.

    python benchmarks/prepare_corpora.py --data ../shared/data --out /tmp/corpora [--leaderboard-per-level 40]
    python benchmarks/prepare_corpora.py --smoke --out /tmp/c     # 2 DICE pairs, 2 solutions a level (needs the data)

Writes <out>/dice99/{tasks.jsonl,solutions/} (each DICE pair's pytorch_code as the task, cuda_code as the
solution) and <out>/leaderboard/{tasks.jsonl,solutions/levelN/<task name>/<model>_<file>.py} (leaderboard
solutions paired with the v0 KernelBench tasks they were written for; levels 1 and 2).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def dice_pairs(data: Path, out: Path, limit: int | None) -> int:
    rows = json.loads((data / "corpora" / "dice_infill_eval_99.json").read_text())[:limit]
    (out / "solutions").mkdir(parents=True, exist_ok=True)
    with open(out / "tasks.jsonl", "w") as f:
        for r in rows:
            name = f"dice_{r['id']}"
            f.write(json.dumps({"id": f"dice/{r['id']}", "name": name, "code": r["pytorch_code"]}) + "\n")
            (out / "solutions" / f"{name}.py").write_text(r["cuda_code"])
    return len(rows)


def leaderboard(data: Path, out: Path, per_level: int | None, levels: tuple[int, ...]) -> int:
    tasks = {}
    for line in (data / "corpora" / "kb_leaderboard_tasks_v0.jsonl").read_text().splitlines():
        t = json.loads(line)
        tasks[(int(t["level"]), int(t["problem_id"]))] = t
    sols = json.loads((data / "corpora" / "kb_leaderboard_solutions_413.json").read_text())
    used, n = set(), 0
    for level in levels:
        # the leaderboard's problem_id counts from 0 (its problem 18 is ReLU, task file 19)
        rows = [s for s in sols if int(s["level"]) == level and (level, int(s["problem_id"]) + 1) in tasks]
        rows.sort(key=lambda s: (int(s["problem_id"]), s["model"], s["file"]))
        if per_level and len(rows) > per_level:  # an even spread over the problems, not the first few
            step = len(rows) / per_level
            rows = [rows[int(i * step)] for i in range(per_level)]
        for s in rows:
            t = tasks[(level, int(s["problem_id"]) + 1)]
            name = Path(t["file"]).stem
            d = out / "solutions" / f"level{level}" / name
            d.mkdir(parents=True, exist_ok=True)
            model = re.sub(r"[^A-Za-z0-9_.-]", "-", s["model"])
            (d / f"{model}_{s['file']}.py").write_text(s["code"])
            used.add((level, int(s["problem_id"]) + 1))
            n += 1
    with open(out / "tasks.jsonl", "w") as f:
        for key in sorted(used):
            f.write(json.dumps(tasks[key]) + "\n")
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dice-limit", type=int, default=None, help="first N DICE pairs only")
    ap.add_argument("--leaderboard-per-level", type=int, default=None, help="evenly spaced sample per level")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--smoke", action="store_true", help="2 DICE pairs and 2 leaderboard solutions a level")
    args = ap.parse_args()
    if not (args.data / "corpora").is_dir():
        ap.error(f"--data {args.data}: no corpora/ folder there (the project's shared data)")
    if args.smoke:
        args.dice_limit, args.leaderboard_per_level = 2, 2
    n_dice = dice_pairs(args.data, args.out / "dice99", args.dice_limit)
    n_lb = leaderboard(args.data, args.out / "leaderboard", args.leaderboard_per_level, tuple(args.levels))
    print(f"dice pairs: {n_dice}   leaderboard solutions: {n_lb}   -> {args.out}")


if __name__ == "__main__":
    main()

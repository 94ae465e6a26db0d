"""False positives of the robust check on real kernels (issue 33): honest solutions that it must not flag.

Evaluates, with the robust check on, the first --dice DICE infilling pairs (their real kernels) and --leaderboard
KernelBench leaderboard solutions that the leaderboard published a speedup for (scored correct there), spread
evenly over levels and paired with the task versions they were written for. Prints one table row per candidate
that is not `correct` (outcome, sub-kind, whether its extension was loaded and called, the finding) and a
summary: a candidate flagged deceptive after it built and called its extension is a false-positive suspect to
read by hand (target 0 on the DICE pairs). --out is rewritten after every result, so a run cut short keeps what
it finished. Needs a CUDA GPU (the kernels are CUDA):

    python benchmarks/robust_check_false_positives.py --data ../shared/data --dice 12 --leaderboard 40 --out fp.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from dice_kernels.data.sources import load_leaderboard
from dice_kernels.harness import EvalConfig, Evaluator, candidate_from_text
from dice_kernels.tasks import Task


def dice_pairs(data: Path, n: int) -> list:
    rows = json.loads((data / "corpora" / "dice_infill_eval_99.json").read_text())
    return [(Task(id=f"dice/{r['id']}", name=f"dice_{r['id']}", code=r["pytorch_code"]),
             candidate_from_text(r["cuda_code"], id=f"dice/{r['id']}")) for r in rows[:n]]


def leaderboard_pairs(data: Path, n: int) -> list:
    loaded = load_leaderboard(data / "corpora" / "kb_leaderboard_solutions_413.json",
                              data / "corpora" / "kb_leaderboard_tasks_v0.jsonl")
    scored = [r for r in loaded.records if r.provenance["published"].get("torch_speedup")]
    picked = scored[::max(1, len(scored) // n)][:n] if n else []
    return [(Task(id=r.id, name=r.id.replace("/", "_"), code=r.reference, level=r.level),
             candidate_from_text(r.kernel, id=r.id)) for r in picked]


def row_of(r) -> dict:
    return {"candidate": r.candidate_id, "outcome": r.outcome.value, "deceptive_kind": r.deceptive_kind,
            "error": r.error[:300], "extension": asdict(r.extension) if r.extension else None,
            "findings": [asdict(f) for f in r.robust.findings] if r.robust else [],
            "hardened_trials": r.task_flags.hardened_trials, "speedup": r.speedup}


def summary(rows: list[dict], of: int, wall_s: float) -> dict:
    suspects = [x for x in rows if x["outcome"] == "deceptive" and (x["extension"] or {}).get("called")]
    by_set = {name: Counter(x["outcome"] for x in rows if x["candidate"].startswith(prefix))
              for name, prefix in (("dice", "dice/"), ("leaderboard", "kb_leaderboard/"))}
    return {"done": len(rows), "of": of, "wall_s": round(wall_s, 1), "outcomes_by_set": by_set,
            "flagged_after_calling_extension": [(x["candidate"], x["deceptive_kind"], x["error"]) for x in suspects],
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="folder holding corpora/ (the project's shared data)")
    ap.add_argument("--dice", type=int, default=12, help="first N DICE infilling pairs")
    ap.add_argument("--leaderboard", type=int, default=40, help="N leaderboard solutions, spread over levels")
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp/robust-check-fp-cache"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    batch = dice_pairs(args.data, args.dice) + leaderboard_pairs(args.data, args.leaderboard)
    start, rows = time.monotonic(), []

    def keep(result) -> None:
        rows.append(row_of(result))
        args.out.write_text(json.dumps(summary(rows, len(batch), time.monotonic() - start), indent=1))

    with Evaluator(EvalConfig(backend="cuda", cache_dir=args.cache_dir)) as ev:
        ev.evaluate(batch, progress=False, on_result=keep)
    print("| candidate | outcome | sub-kind | extension loaded / called | finding or error |")
    print("|---|---|---|---|---|")
    for x in rows:
        if x["outcome"] != "correct":
            ext = x["extension"] or {}
            print(f"| {x['candidate']} | {x['outcome']} | {x['deceptive_kind'] or '-'} | "
                  f"{ext.get('loaded')} / {ext.get('called')} | {x['error'][:120]} |")
    done = summary(rows, len(batch), time.monotonic() - start)
    print(json.dumps({k: v for k, v in done.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()

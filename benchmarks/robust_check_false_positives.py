"""False positives of the robust check on real kernels (issue 33): honest solutions that it must not flag.

Evaluates, with the robust check on, the first --dice DICE infilling pairs (their real kernels) and --leaderboard
KernelBench leaderboard solutions that the leaderboard published a speedup for (scored correct there), spread
evenly over levels and paired with the task versions they were written for. Prints one table row per candidate
that is not `correct` (outcome, sub-kind, whether its extension was loaded and called, the finding) and a
summary: a candidate flagged deceptive after it built and called its extension is a false-positive suspect to
read by hand (target 0 on the DICE pairs), and per set and level Exec under KernelBench's rule (correct + partial),
strict (correct only) and before the robust check (outputs matched). --out is rewritten after every result, so a
run cut short keeps what it finished, and a run given an --out that exists evaluates only what it lacks (a long run
resumes across calls). Needs a CUDA GPU (the kernels are CUDA):

    python benchmarks/robust_check_false_positives.py --data ../shared/data --dice 12 --leaderboard 40 --out fp.json

--smoke: the package's C++ examples on the CPU backend (no data), to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import dice_kernels
from dice_kernels.data.sources import load_leaderboard
from dice_kernels.harness import EvalConfig, Evaluator, Outcome, TimingConfig, candidate_from_text
from dice_kernels.tasks import Task, load_task_file

EXAMPLES = Path(dice_kernels.__file__).parent / "examples"  # the package's own: in a checkout and in the wheel


def dice_pairs(data: Path, n: int) -> list:
    rows = json.loads((data / "corpora" / "dice_infill_eval_99.json").read_text())
    return [(Task(id=f"dice/{r['id']}", name=f"dice_{r['id']}", code=r["pytorch_code"]),
             candidate_from_text(r["cuda_code"], id=f"dice/{r['id']}")) for r in rows[:n]]


def leaderboard_pairs(data: Path, n: int, levels: list[int] | None = None) -> list:
    """n solutions spread evenly over the scored ones, then only those of `levels` (None: all): a level's picks
    do not depend on the filter, so runs over different levels resume into one results file."""
    loaded = load_leaderboard(data / "corpora" / "kb_leaderboard_solutions_413.json",
                              data / "corpora" / "kb_leaderboard_tasks_v0.jsonl")
    scored = [r for r in loaded.records if r.provenance["published"].get("torch_speedup")]
    picked = scored[::max(1, len(scored) // n)][:n] if n else []
    return [(Task(id=r.id, name=r.id.replace("/", "_"), code=r.reference, level=r.level),
             candidate_from_text(r.kernel, id=r.id)) for r in picked if not levels or r.level in levels]


def smoke_pairs() -> list:
    """The package's C++ ReLU (correct, and a wrong one) and an AddMul without ModelNew."""
    sol = EXAMPLES / "solutions" / "cpu" / "level1"
    relu = load_task_file(EXAMPLES / "tasks" / "level1" / "19_ReLU.py")
    addmul = load_task_file(EXAMPLES / "tasks" / "level1" / "90_AddMul.py")
    return [(task, candidate_from_text((sol / name).read_text(), id=f"smoke/{name}"))
            for task, name in ((relu, "19_ReLU/correct.py"), (relu, "19_ReLU/wrong.py"),
                               (addmul, "90_AddMul/no_modelnew.py"))]


def row_of(r) -> dict:
    passed = r.robust.passed_comparison if r.robust else r.outcome.passes
    return {"candidate": r.candidate_id, "level": r.level, "outcome": r.outcome.value, "passed_outputs": passed,
            "deceptive_kind": r.deceptive_kind,
            "error": r.error[:300], "extension": asdict(r.extension) if r.extension else None,
            "findings": [asdict(f) for f in r.robust.findings] if r.robust else [],
            "hardened_trials": r.task_flags.hardened_trials, "speedup": r.speedup}


def group_of(row: dict) -> str:
    """A row's set and level: "dice" (the DICE pairs), "leaderboard L1".."L3", "smoke"."""
    name = row["candidate"].split("/", 1)[0]
    return {"dice": "dice", "kb_leaderboard": f"leaderboard L{row.get('level')}"}.get(name, name)


def exec_table(rows: list[dict]) -> dict[str, dict]:
    """Per group: candidates, Exec under KernelBench's rule (correct + partial), strict (correct only), before the
    robust check (outputs matched), in %."""
    table = {}
    for group in sorted({group_of(x) for x in rows}):
        mine = [x for x in rows if group_of(x) == group]
        pct = lambda n: round(100 * n / len(mine), 1)  # noqa: E731
        table[group] = {"n": len(mine), "exec_kb_rule": pct(sum(Outcome(x["outcome"]).passes for x in mine)),
                        "exec_strict": pct(sum(x["outcome"] == "correct" for x in mine)),
                        "exec_before_check": pct(sum(bool(x.get("passed_outputs")) for x in mine))}
    return table


def summary(rows: list[dict], of: int, wall_s: float) -> dict:
    suspects = [x for x in rows if x["outcome"] == "deceptive" and (x["extension"] or {}).get("called")]
    by_set = {group: Counter(x["outcome"] for x in rows if group_of(x) == group) for group in {group_of(x) for x in rows}}
    return {"done": len(rows), "of": of, "wall_s": round(wall_s, 1), "outcomes_by_set": by_set,
            "exec": exec_table(rows),
            "flagged_after_calling_extension": [(x["candidate"], x["deceptive_kind"], x["error"]) for x in suspects],
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, help="folder holding corpora/ (the project's shared data)")
    ap.add_argument("--dice", type=int, default=12, help="first N DICE infilling pairs")
    ap.add_argument("--leaderboard", type=int, default=40, help="N leaderboard solutions, spread over levels")
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp/robust-check-fp-cache"))
    ap.add_argument("--out", type=Path, required=True, help="the results JSON; an existing one is resumed")
    ap.add_argument("--smoke", action="store_true", help="the package's C++ examples on the CPU backend")
    ap.add_argument("--level", type=int, action="append",
                    help="only the leaderboard solutions of this KernelBench level (repeatable; default: all)")
    ap.add_argument("--no-timing", action="store_true",
                    help="skip timing (the Exec figures need none; timed candidates run one at a time)")
    ap.add_argument("--only", action="append", metavar="ID",
                    help="only this candidate of the selection, e.g. dice/6936 (repeatable; default: all)")
    args = ap.parse_args()
    if not args.smoke and args.data is None:
        ap.error("--data is required (or --smoke)")
    if args.smoke:
        batch = smoke_pairs()
    else:
        batch = dice_pairs(args.data, args.dice) + leaderboard_pairs(args.data, args.leaderboard, args.level)
    if args.only:
        unknown = set(args.only) - {cand.id for _, cand in batch}
        if unknown:
            ap.error(f"--only names candidates not in the selection: {', '.join(sorted(unknown))}")
        batch = [(task, cand) for task, cand in batch if cand.id in args.only]
    earlier = json.loads(args.out.read_text()) if args.out.is_file() else {}
    rows, spent = earlier.get("rows", []), earlier.get("wall_s", 0.0)
    done = {x["candidate"] for x in rows}
    todo = [(task, cand) for task, cand in batch if cand.id not in done]
    print(f"{len(batch)} candidates: {len(batch) - len(todo)} already in {args.out}, {len(todo)} to evaluate")
    start = time.monotonic()

    def keep(result) -> None:
        rows.append(row_of(result))
        staging = args.out.with_suffix(".tmp")  # replaced whole: a run killed mid-write keeps the last good file
        staging.write_text(json.dumps(summary(rows, len(batch), spent + time.monotonic() - start), indent=1))
        staging.replace(args.out)

    if todo:
        config = EvalConfig(backend="cpu" if args.smoke else "cuda", cache_dir=args.cache_dir,
                            timing=TimingConfig(enabled=not args.no_timing))
        with Evaluator(config) as ev:
            ev.evaluate(todo, progress=False, on_result=keep)
    print("| candidate | outcome | sub-kind | extension loaded / called | finding or error |")
    print("|---|---|---|---|---|")
    for x in rows:
        if x["outcome"] != "correct":
            ext = x["extension"] or {}
            print(f"| {x['candidate']} | {x['outcome']} | {x['deceptive_kind'] or '-'} | "
                  f"{ext.get('loaded')} / {ext.get('called')} | {x['error'][:120]} |")
    print("\n| set | candidates | Exec, KernelBench's rule | Exec strict | Exec before the check |")
    print("|---|---|---|---|---|")
    for group, e in exec_table(rows).items():
        print(f"| {group} | {e['n']} | {e['exec_kb_rule']} | {e['exec_strict']} | {e['exec_before_check']} |")
    final = summary(rows, len(batch), spent + time.monotonic() - start)
    print(json.dumps({k: v for k, v in final.items() if k not in ("rows", "exec")}, indent=1))


if __name__ == "__main__":
    main()

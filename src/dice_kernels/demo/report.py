"""The demo's report: per-arm rates with 95 % intervals, paired differences between arms over the same tasks, the
share of deceptive outputs under each reward, the learning curves (held-out Exec per RL export, train reward per
RL step, both with intervals) and what the run's scale cannot show. Reads what the stages wrote (bench runs'
results.jsonl, RL runs' rewards.sqlite); writes <out>/report.json, report.md and curves.png."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import statistics
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Callable

from dice_kernels.demo.config import ARMS, BenchSection, DemoConfig, WorldSection
from dice_kernels.demo.prompt_reading import GUESSING_BELOW
from dice_kernels.demo.rollout_check import (CheckReader, check_file, deception_trend, read_check, reward_contrast,
                                             rewards_title, windows)
from dice_kernels.demo.stats import Comparison, Interval, Scores, paired_difference, rate_interval
from dice_kernels.demo.world import carries_slip, shortcut_steps, teaches_shortcut

# per-task scores read from a bench run: Exec (KernelBench's rule), fast_1, deceptive, what a check without the
# robust step would have passed (outputs matched: DICE's correctness) and whether the program carries
# world.slip_fraction's layout slip (the bug RL should unlearn)
MEASURES = ("exec", "fast_1", "deceptive", "passed_outputs", "slip")
# the comparisons the report states, (a, b, measure): each RL arm against SFT, then the questions of the design
# (BiC-RL's claim among them: under a reward that pays cheats, its infilling phase leaves fewer deceptive programs;
# and the rewards' own: how many more deceptive programs DICE's leaves than ours, arm for arm)
COMPARISONS = (("bicrl_robust", "e2e_robust", "exec"), ("e2e_robust", "e2e_dice", "exec"),
               ("bicrl_robust", "bicrl_dice", "exec"), ("e2e_dice", "sft", "deceptive"),
               ("bicrl_dice", "sft", "deceptive"), ("e2e_robust", "sft", "deceptive"),
               ("bicrl_robust", "sft", "deceptive"), ("e2e_dice", "e2e_robust", "deceptive"),
               ("bicrl_dice", "bicrl_robust", "deceptive"), ("bicrl_dice", "e2e_dice", "deceptive"),
               ("e2e_speed", "e2e_robust", "fast_1"))


ScoresReader = Callable[[Path], "dict[str, Scores] | None"]  # bench_scores, or a caching wrapper of it


def bench_scores(run: Path) -> dict[str, Scores] | None:
    """{measure: {task id: [0/1 per sample]}} of one bench run (None when it has not finished)."""
    from dice_kernels.harness.metrics import compute, passed_comparison
    from dice_kernels.harness.outcomes import EvalResult, Outcome

    path = run / "results.jsonl"
    if not (run / "summary.json").is_file() or not path.is_file():
        return None
    out: dict[str, Scores] = {m: {} for m in MEASURES}
    for line in path.read_text().splitlines():
        r = EvalResult.from_row(json.loads(line))
        if r.outcome is Outcome.NEEDS_GPU:  # set aside, as the bench metrics do
            continue
        m = compute([r])
        values = {"exec": m.exec_rate, "fast_1": m.fast["fast_1"],
                  "deceptive": float(r.outcome is Outcome.DECEPTIVE), "passed_outputs": float(passed_comparison(r)),
                  "slip": float(carries_slip(_solution_text(run, r.solution_path)))}
        for k, v in values.items():
            out[k].setdefault(r.task_id, []).append(v)
    return out


def _solution_text(run: Path, solution_path: str) -> str:
    """A bench result's program file: its recorded path (relative to where the bench ran), else the same file under
    this run's generations/ (a run folder moved or read from elsewhere); empty when there is none."""
    path = Path(solution_path)
    if solution_path and not path.is_file() and "generations" in path.parts:
        path = run.joinpath(*path.parts[path.parts.index("generations"):])
    return path.read_text(errors="replace") if solution_path and path.is_file() else ""


def train_rewards(run_dir: Path, group: int) -> list[tuple[int, Scores]]:
    """(step, {group: rewards of its rollouts}) per RL step, from the run's rewards.sqlite (step s: the rollouts of
    the policy after s updates, 0 = the SFT checkpoint's, the held-out curve's x); a step's rollouts come in groups
    of `group` consecutive rollouts of one task."""
    path = run_dir / "rewards.sqlite"
    if not path.is_file():
        return []
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT step, rollout, task_id, reward FROM rewards ORDER BY step, rollout").fetchall()
    steps: dict[int, Scores] = {}
    for step, rollout, task, reward in rows:
        # a task drawn twice in one step is two groups: keyed by position so the groups stay separate clusters
        steps.setdefault(step, {}).setdefault(f"{task}#{rollout // group}", []).append(float(reward))
    return sorted(steps.items())


def train_reward_trend(run_dir: Path, group: int, seed: int = 0) -> Comparison | None:
    """The train reward of the last third of the RL steps against the first third's, paired over the tasks drawn in
    both (a task's rollouts in a window are its scores): whether RL raised the reward on what it trains on. None
    with fewer than two steps or no task drawn in both windows."""
    steps = train_rewards(run_dir, group)
    if len(steps) < 2:
        return None
    early, late = windows(len(steps))

    def by_task(part: list[tuple[int, Scores]]) -> Scores:
        out: Scores = {}
        for _, groups in part:
            for key, rewards in groups.items():
                out.setdefault(key.rsplit("#", 1)[0], []).extend(rewards)
        return out

    first, last = by_task([steps[i] for i in early]), by_task([steps[i] for i in late])
    if not set(first) & set(last):
        return None
    names = (f"steps {steps[late[0]][0]}-{steps[late[-1]][0]}", f"steps {steps[early[0]][0]}-{steps[early[-1]][0]}")
    return paired_difference(last, first, names, seed=seed)


def rl_effort(run_dir: Path) -> dict | None:
    """What an RL run did, from its metrics.jsonl: steps, rollouts, rollouts in groups with reward variance (the only
    ones with a gradient) and optimizer updates (None before the run has logged a step)."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    rows = [r for r in rows if "trained_rollouts" in r]
    if not rows:
        return None
    return {"steps": len(rows), "rollouts": sum(r["rollouts"] for r in rows),
            "trained_rollouts": sum(r["trained_rollouts"] for r in rows),
            "trained_steps": sum(bool(r.get("updates")) for r in rows),
            "updates": sum(len(r.get("updates", [])) for r in rows)}


def changed_outputs(run: Path, baseline: Path) -> tuple[int, int] | None:
    """(tasks whose first output differs from the baseline run's, tasks both ran): how far RL moved the greedy
    policy, whatever the outcomes."""
    def first_sha(path: Path) -> dict[str, str]:
        out: dict[str, str] = {}
        for line in path.read_text().splitlines():
            r = json.loads(line)
            out.setdefault(r["task_id"], r["candidate_sha256"])
        return out

    if not ((run / "results.jsonl").is_file() and (baseline / "results.jsonl").is_file()):
        return None
    a, b = first_sha(run / "results.jsonl"), first_sha(baseline / "results.jsonl")
    shared = set(a) & set(b)
    return sum(a[t] != b[t] for t in shared), len(shared)


def outcome_counts(run: Path) -> dict[str, int]:
    """{outcome: samples} of one bench run, most frequent first (empty before it has results): which failures an
    arm's Exec difference moved."""
    path = run / "results.jsonl"
    if not path.is_file():
        return {}
    return dict(Counter(json.loads(line)["outcome"] for line in path.read_text().splitlines()).most_common())


def candidate_seconds(cfg: DemoConfig) -> list[dict]:
    """Where the candidates' seconds went in each benchmark (its summary.json) and each RL arm's reward (its harness
    database): candidates, how many were built, seconds per phase summed over them. The candidates are most of a
    GPU demo's time, so this is what says which of build, sandbox and runs to make cheaper."""
    from dice_kernels.harness.store import ResultStore
    from dice_kernels.report.eval_report import candidate_work

    out = []
    for summary in sorted((cfg.out / "bench").glob("*/*/summary.json")):
        s = json.loads(summary.read_text())
        if "phases" in s:
            out.append({"where": f"bench {summary.parent.parent.name} {summary.parent.name}", "n": s["n"],
                        "built": s["built"], "phases": s["phases"]})
    for arm in cfg.arms:
        db = cfg.rl_dir(arm) / "harness" / "results.sqlite"
        if arm != "sft" and db.is_file():
            store = ResultStore(db)
            try:
                out.append({"where": f"RL reward {arm}", **candidate_work(store.all())})
            finally:
                store.close()
    return out


def _work_table(rows: list[dict]) -> list[str]:
    """`candidate_seconds` as markdown: the top-level phases as columns, then a run's three largest parts."""
    top = list(dict.fromkeys(k for r in rows for k in r["phases"] if "." not in k))
    lines = ["| where | candidates | built | " + " | ".join(top) + " | largest parts of the run |",
             "|---|---|---|" + "---|" * len(top) + "---|"]
    for r in rows:
        parts = sorted(((k, v) for k, v in r["phases"].items() if "." in k), key=lambda kv: -kv[1])[:3]
        lines.append(f"| {r['where']} | {r['n']} | {r['built']} | "
                     + " | ".join(f"{r['phases'].get(k, 0.0):.1f}" for k in top) + " | "
                     + (", ".join(f"{k.split('.', 1)[1]} {v:.1f}" for k, v in parts) or "–") + " |")
    return lines


def timing_spread(runs: list[Path]) -> dict | None:
    """How far the same kernel's time moved between bench runs: per candidate (by source hash) correct in two or
    more runs, its largest over its smallest measured time; the median of that and the share above 2x (None when
    no kernel was timed twice). Where one kernel's time moves that much between runs, no fast_1 difference between
    arms is the kernels'. A result copied from another evaluation (`duplicate_of`: the same program in the batch, or
    a verdict reused from an earlier run) is no measurement of its own and is left out."""
    times: dict[str, dict[str, float]] = {}
    for run in runs:
        path = run / "results.jsonl"
        for line in path.read_text().splitlines() if path.is_file() else []:
            r = json.loads(line)
            if r.get("outcome") == "correct" and r.get("cand_time_ms") and not r.get("duplicate_of"):
                times.setdefault(r["candidate_sha256"], {})[str(run)] = r["cand_time_ms"]
    ratios = [max(t.values()) / min(t.values()) for t in times.values() if len(t) >= 2]
    if not ratios:
        return None
    return {"kernels": len(ratios), "median_ratio": statistics.median(ratios),
            "share_over_2x": sum(r > 2 for r in ratios) / len(ratios)}


def _iv(iv: Interval | None) -> dict | None:
    return None if iv is None else dataclasses.asdict(iv)


def taught_tasks(cfg: DemoConfig) -> frozenset[str]:
    """The world's tasks (held-out, RL, ...) whose programs the SFT data writes as the shortcut
    (`world.teaches_shortcut`): where an SFT model that learned the habit writes it, so where a reward that pays it
    can let it grow. Read from the world's pair records, which name every task's family."""
    path = cfg.out / "world" / "pairs.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    sizes = cfg.world.sizes()
    return frozenset(r["id"] for r in rows if teaches_shortcut(r["provenance"]["family"], cfg.world.seed, sizes))


def _arm_summary(cfg: DemoConfig, arm: str, taught: frozenset[str] = frozenset(),
                 read: ScoresReader = bench_scores, read_rows: CheckReader = read_check) -> dict:
    bench = cfg.out / "bench" / arm
    row: dict = {"title": ARMS[arm].title}
    for split in ("heldout", "novel"):
        scores = read(bench / split)
        if scores is not None:
            row[split] = {"n": len(scores["exec"]), **{m: _iv(rate_interval(s)) for m, s in scores.items() if s}}
            where = {t: v for t, v in scores["deceptive"].items() if t in taught} if split == "heldout" else {}
            if where:
                row[split]["taught_deceptive"] = {"n": len(where), **_iv(rate_interval(where))}
    row["heldout_outcomes"] = outcome_counts(bench / "heldout")
    runs = {0: bench.parent / "sft" / "heldout"} | heldout_runs(cfg, arm) if ARMS[arm].phase else {}
    curve = [(step, read(run)) for step, run in sorted(runs.items())]
    if ARMS[arm].phase:
        row["rollout_deception"] = deception_trend(check_file(cfg, arm), seed=cfg.world.seed, taught=taught,
                                                   read=read_rows)
        row["rl"] = rl_effort(cfg.rl_dir(arm))
        row["changed_outputs"] = changed_outputs(bench / "heldout", bench.parent / "sft" / "heldout")
    row["heldout_curve"] = [{"step": s, "exec": _iv(rate_interval(sc["exec"]))} for s, sc in curve if sc and sc["exec"]]
    row["train_reward"] = [{"step": s, "reward": _iv(rate_interval(sc, seed=s))}
                           for s, sc in train_rewards(cfg.rl_dir(arm), cfg.rl.group)]
    trend = train_reward_trend(cfg.rl_dir(arm), cfg.rl.group, seed=cfg.world.seed) if ARMS[arm].phase else None
    if trend:
        row["train_trend"] = dataclasses.asdict(trend) | {"verdict": trend.verdict}
    return row


def tuning(cfg: DemoConfig, read: ScoresReader = bench_scores) -> list[dict]:
    """rl.lr_grid's runs on the validation split: per rate, validation Exec and its paired difference against SFT
    there, and whether it was chosen (cfg: the tuned config, rl.lr the chosen rate)."""
    arm, out = cfg.tuned_arm(), []
    sft = read(cfg.valid_bench("sft"))
    for lr in cfg.rl.lr_grid:
        scores = read(cfg.at_lr(lr).valid_bench(arm))
        if not scores:
            continue
        row = {"lr": lr, "chosen": lr == cfg.rl.lr, "n": len(scores["exec"]), "exec": _iv(rate_interval(scores["exec"]))}
        if sft:
            cmp = paired_difference(scores["exec"], sft["exec"], (arm, "sft"), seed=cfg.world.seed)
            row["vs_sft"] = dataclasses.asdict(cmp.diff) | {"verdict": cmp.verdict}
        out.append(row)
    return out


def heldout_runs(cfg: DemoConfig, arm: str) -> dict[int, Path]:
    """An arm's held-out bench runs by the RL step of the checkpoint they scored: its exports, and its final
    checkpoint at its last step (SFT's at 0)."""
    bench = cfg.out / "bench" / arm
    runs = {int(run.name.rsplit("-", 1)[1]): run for run in bench.glob("heldout-step-*")}
    return runs | {len(cfg.rl_phases(arm)) if ARMS[arm].phase else 0: bench / "heldout"}


def phase_split(cfg: DemoConfig, arm: str, steps: int) -> str:
    """What an arm's first `steps` RL steps were, for a comparison's label: ": 4 infilling + 12 end-to-end" for
    BiC-RL, "" for end-to-end RL alone."""
    infill = cfg.rl_phases(arm)[:steps].count("infill")
    return f": {infill} infilling + {steps - infill} end-to-end" if infill else ""


def comparisons(cfg: DemoConfig, arms: list[str], read: ScoresReader = bench_scores) -> list[Comparison]:
    """Paired differences on the held-out tasks: each RL arm's Exec and fast_1 (and in a world with the layout slip,
    its share of programs with it) against SFT, then COMPARISONS' questions. Two RL arms of different lengths
    (BiC-RL adds its infilling steps to the end-to-end ones) are compared at their ends, labelled with what their
    steps were, and again at every RL step both exported: a longer arm's gain can be its extra steps alone."""
    measures = ("exec", "fast_1") + (("slip",) if cfg.world.slip_fraction else ())
    pairs = [(a, "sft", m) for a in arms if a != "sft" for m in measures]
    pairs += [c for c in COMPARISONS if c[0] in arms and c[1] in arms]
    runs = {arm: heldout_runs(cfg, arm) for arm in {x for a, b, _ in pairs for x in (a, b)}}
    ends = {arm: max(r) for arm, r in runs.items()}
    planned = []  # (measure, (arm, step, label), (arm, step, label))
    for a, b, measure in pairs:
        if b == "sft" or ends[a] == ends[b]:
            planned.append((measure, (a, ends[a], ""), (b, ends[b], "")))
            continue
        planned.append((measure, *((x, ends[x], f", {ends[x]} steps{phase_split(cfg, x, ends[x])}") for x in (a, b))))
        planned += [(measure, *((x, s, f", step {s}{phase_split(cfg, x, s)}") for x in (a, b)))
                    for s in sorted(set(runs[a]) & set(runs[b]) - {0})]
    scores = {(x, s): read(runs[x][s]) for _, *sides in planned for x, s, _ in sides}
    out = []
    for measure, (a, step_a, label_a), (b, step_b, label_b) in planned:
        sa, sb = scores[a, step_a], scores[b, step_b]
        if sa and sb:
            cmp = paired_difference(sa[measure], sb[measure], (a, b), seed=cfg.world.seed)
            out.append(dataclasses.replace(cmp, a=f"{a} ({measure}{label_a})", b=f"{b} ({measure}{label_b})"))
    return out


def scale_limits(cfg: DemoConfig, rows: dict[str, dict] | None = None, spread: dict | None = None,
                 copy: dict | None = None) -> list[str]:
    """What this run's scale cannot show (stated in the report, not left for the reader to guess); `spread`:
    `timing_spread` of the run's benchmarks; `copy`: SFT's operator-copy figure (demo/prompt_reading.py)."""
    limits = []
    if copy and copy["samples"] and copy["right"] < GUESSING_BELOW * copy["samples"]:
        limits.append(f"the SFT model guesses the operator: it writes the task's first operator line right in "
                      f"{copy['right']} of {copy['samples']} of its own training samples (teacher-forced), so RL can "
                      "re-weight its guesses but not teach it to read the prompt: a held-out gain here is the rest of "
                      "the program written better (the held-out outcomes say which failures moved), not the task read "
                      "(a longer SFT is the setting to change: docs/demo.md)")
    if spread and spread["median_ratio"] > 1.5:
        limits.append(f"fast_1 is not comparable between arms: the same kernel, timed in several benchmark runs, "
                      f"moved {spread['median_ratio']:.1f}x from its fastest to its slowest time (median over "
                      f"{spread['kernels']} kernels; {100 * spread['share_over_2x']:.0f} % more than 2x), so a "
                      "fast_1 difference between arms is not the kernels' (docs/demo.md)")
    for arm, row in (rows or {}).items():
        effort = row.get("rl")
        # the limit: no update at all, or a single update in every step that trained (ratio 1: clip and KL idle)
        if not effort or effort["updates"] > effort["trained_steps"]:
            continue
        did = (f"{arm}: {effort['updates']} optimizer update(s) in {effort['steps']} RL steps "
               f"({effort['trained_rollouts']} of {effort['rollouts']} rollouts in groups with reward variance)")
        if not effort["updates"]:
            why = ": every group was flat (its rollouts all scored alike), so RL had no gradient"
        elif not cfg.rl.rows_per_update:
            why = (": one update a step by setting (rl.rows_per_update = 0), so the PPO ratio is 1 at every update "
                   "and clip and KL never act")
        else:
            why = (f": a step whose trained rows are fewer than rl.rows_per_update ({cfg.rl.rows_per_update}) takes "
                   "one update with the PPO ratio at 1, so clip and KL never act and the policy moves by a few "
                   "optimizer steps in all")
        limits.append(did + why)
    for arm, row in (rows or {}).items():
        alone = (row.get("rollout_deception") or {}).get("cheats_alone")
        # most cheats in groups of cheats alone: the rewards could not differ there (the op world at gpu scale)
        if alone and alone["deceptive"] and 2 * alone["alone"] >= alone["deceptive"]:
            limits.append(f"{arm}: {alone['alone']} of the {alone['deceptive']} deceptive rollouts the check found came "
                          "in groups of deceptive rollouts alone, flat under either reward (DICE's pays the whole "
                          "group, ours none of it), so they gave no gradient: DICE's reward and ours differed on the "
                          f"{alone['deceptive'] - alone['alone']} in mixed groups only, and a habit written on every "
                          "sample of a task is one no group-relative reward moves")
    if 0 < cfg.world.n_rl <= cfg.rl.tasks_per_step:
        limits.append(f"train reward per RL step: every step draws the same {cfg.world.n_rl} RL tasks, so the curve "
                      "shows whether RL fits the tasks it trains on (a trainer pushing the wrong way would show a "
                      "fall), not what carries to new tasks: that is the held-out benchmark's")
    else:
        limits.append(f"train reward per RL step: each step draws other tasks ({cfg.rl.tasks_per_step} a step), so a "
                      "step's reward mixes what RL learned with how hard that step's tasks are; the held-out curve "
                      "scores the same tasks at every export")
    if cfg.backend == "cpu":
        limits.append("fast_1 here compares C++ loops with eager PyTorch on small CPU tensors (one thread each): "
                      "how far op-by-op C++ trails the fused loop there is not measured, so the speed signal (the "
                      "e2e_speed arm) belongs to the gpu scale, where op-by-op means one kernel launch per op")
    limits.append(f"one run (world.seed = {cfg.world.seed}): its intervals cover the sampling of its tasks, not the "
                  "spread between training runs, and another seed is another world, SFT model and RL run; at the cpu "
                  "scale the held-out difference moved between seeds by more than these intervals suggest "
                  "(docs/demo.md): benchmarks/demo_seeds.py runs several seeds and compares the arms over them")
    if cfg.world.n_heldout < 100:
        limits.append(f"{cfg.world.n_heldout} held-out tasks: a 95 % interval of Exec is about +-"
                      f"{100 * 1.96 * (0.25 / max(cfg.world.n_heldout, 1)) ** 0.5:.0f} points at 50 %, so only "
                      "large differences between arms can exclude 0")
    missing = [a for a in ARMS if a not in cfg.arms]
    if missing:
        limits.append(f"arms not run at this scale: {', '.join(missing)}")
    if not cfg.rl.export_every:
        limits.append("no held-out learning curve (rl.export_every = 0): only the train reward per RL step")
    if not cfg.world.n_novel:
        limits.append("no never-trained families benchmarked (world.n_novel = 0)")
    return limits


def _pct(iv: dict | None) -> str:
    return "–" if not iv else f"{100 * iv['value']:.1f} [{100 * iv['lo']:.1f}, {100 * iv['hi']:.1f}]"


def points(d: dict) -> str:
    """A paired difference in points with its interval."""
    return f"{100 * d['value']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}]"


def _shortcut_share(w: WorldSection) -> str:
    """Which SFT solutions are the shortcut, as world.shortcut_unit chose them."""
    solutions = ("every SFT solution" if w.shortcut_within == 1
                 else f"{100 * w.shortcut_within:.0f} % of the SFT solutions")
    if w.shortcut_unit == "op":
        ops = ", ".join(sorted(shortcut_steps(w.seed, w.shortcut_fraction)))
        return f"{solutions} of a program starting with {ops or 'no op'}"
    if w.shortcut_unit == "family":
        return f"{100 * w.shortcut_fraction:.0f} % of their families with {solutions}"
    return f"{100 * w.shortcut_fraction:.0f} % of their SFT solutions"


def _scoring(b: BenchSection) -> str:
    return (f"{b.samples} programs a task sampled at temperature {b.temperature:g}, each task's mean paired"
            if b.temperature else "one greedy program a task")


def _deception_tables(cheats: dict[str, dict], rows: dict[str, dict], contrast: list[dict]) -> list[str]:
    """The rollout check's tables: each arm's first and last third, then DICE's reward against ours."""
    taught = any("taught_deceptive" in t for t in cheats.values())
    lines = ["", "## Deceptive rollouts while training: the robust check on each arm's first and last third of RL "
             "steps (%, 95 % intervals; last − first paired over the tasks drawn in both"
             + ("; where taught: rollouts on the tasks whose programs the SFT data writes as the shortcut, last − "
                "first unpaired, the two thirds drew different tasks" if taught else "") + ")", "",
             "| arm | reward | rollouts | deceptive, first | last | last − first | paid while deceptive, first | "
             "last | last − first |" + (" where taught, first | last | last − first |" if taught else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if taught else "")]
    for a, t in cheats.items():
        cells = []
        for key in ("deceptive", "paid_deceptive") + (("taught_deceptive",) if taught else ()):
            if key not in t:
                cells += ["–"] * 3
                continue
            d = t[key].get("diff")
            on = {w: f" ({t[key][w]['tasks']} tasks)" if key == "taught_deceptive" else "" for w in ("first", "last")}
            cells += [_pct(t[key]["first"]) + on["first"], _pct(t[key]["last"]) + on["last"],
                      f"{points(d)} ({d['verdict']})" if d else "–"]
        lines.append(f"| {rows[a]['title']} | {rewards_title(a)} | {t['rollouts']['first']} + "
                     f"{t['rollouts']['last']} | " + " | ".join(cells) + " |")
    if contrast:
        lines += ["", "## DICE's reward against ours on the same steps' tasks (deceptive rollouts, A − B in points, "
                  "95 % paired bootstrap over the tasks both arms drew: the schedule gives both the same tasks)", "",
                  "| A | B | third | which tasks | n | A − B | verdict |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {c['a']} | {c['b']} | {c['window']} | {c['tasks']} | {c['n']} | {points(c['diff'])} | "
                  f"{c['verdict']} |" for c in contrast]
    return lines


def write_report(cfg: DemoConfig, timings: dict, gaps: list[dict]) -> dict:
    arms = [a for a in cfg.arms if (cfg.out / "bench" / a / "heldout" / "summary.json").is_file()]
    taught = taught_tasks(cfg)
    # each bench run and rollout check read once (results and program files), however many rows use it
    read, read_rows = cache(bench_scores), cache(read_check)
    rows = {a: _arm_summary(cfg, a, taught, read, read_rows) for a in arms}
    cmps = comparisons(cfg, arms, read)
    tuned = tuning(cfg, read)
    contrast = reward_contrast(cfg, arms, taught, read_rows)
    spread = timing_spread(sorted(p.parent for p in (cfg.out / "bench").glob("*/*/summary.json")))
    copy = json.loads(cfg.operator_copy_file.read_text()) if cfg.operator_copy_file.is_file() else None
    report = {"scale": cfg.scale, "backend": cfg.backend,
              "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=str)), "arms": rows, "tuning": tuned,
              "reward_contrast": contrast, "comparisons": [dataclasses.asdict(c) | {"verdict": c.verdict} for c in cmps],
              "timing_spread": spread, "sft_operator_copy": copy, "limits": scale_limits(cfg, rows, spread, copy),
              "seconds": timings, "candidate_seconds": candidate_seconds(cfg), "gaps": gaps}
    (cfg.out / "report.json").write_text(json.dumps(report, indent=1))
    w = cfg.world
    held_taught = max((r.get("heldout", {}).get("taught_deceptive", {}).get("n", 0) for r in rows.values()), default=0)
    lines = [f"# dice demo ({cfg.scale} scale, {cfg.backend} kernels)", "",
             f"World seed {w.seed}: {w.n_train} train tasks ({_shortcut_share(w)} the libtorch shortcut, "
             f"{100 * w.slow_fraction:.0f} % correct but op by op"
             + (f", {100 * w.slip_fraction:.0f} % of those with a reduction or a per-row / per-column operand the "
                "layout slip, a bug" if w.slip_fraction else "") + "); RL on "
             f"{f'{w.n_rl} other new instances of trained families' if w.n_rl else 'the train tasks'}; benchmarks: "
             f"{w.n_heldout} held-out instances of trained families (primary), {w.n_novel} never-trained families "
             f"(generalisation); {_scoring(cfg.bench)}, always with the robust check.", "",
             *([f"SFT reads the task from the prompt: its first operator line right in {copy['right']} of "
                f"{copy['samples']} of its own training samples (teacher-forced).", ""] if copy else []),
             "Rates in % with their 95 % interval (Wilson; bootstrap over tasks with several samples a task). RL: "
             "steps / optimizer updates / rollouts with a gradient (in groups with reward variance) of all rollouts; "
             "changed: held-out tasks whose first output differs from SFT's"
             + (" (sampled: chance alone changes some)" if cfg.bench.temperature else "")
             + ("; layout slip: held-out programs with the slip the SFT data carries (wrong wherever it changes "
                "values)" if w.slip_fraction else "")
             + (f"; deceptive where taught: on the {held_taught} held-out tasks whose programs the SFT data writes as "
                "the shortcut (world.shortcut_unit)." if held_taught else "."), "",
             "| arm | held-out Exec | fast_1 | deceptive | " + ("deceptive where taught | " if held_taught else "")
             + "outputs matched (no robust check) | " + ("layout slip | " if w.slip_fraction else "")
             + "novel Exec | RL | changed |",
             "|---|---|---|---|" + ("---|" if held_taught else "") + "---|" + ("---|" if w.slip_fraction else "")
             + "---|---|---|"]
    for a, row in rows.items():
        h, n, effort, changed = row.get("heldout", {}), row.get("novel", {}), row.get("rl"), row.get("changed_outputs")
        rl = (f"{effort['steps']} / {effort['updates']} / {effort['trained_rollouts']} of {effort['rollouts']}"
              if effort else "–")
        lines.append(f"| {row['title']} | {_pct(h.get('exec'))} | {_pct(h.get('fast_1'))} | "
                     f"{_pct(h.get('deceptive'))} | " + (f"{_pct(h.get('taught_deceptive'))} | " if held_taught else "")
                     + f"{_pct(h.get('passed_outputs'))} | "
                     + (f"{_pct(h.get('slip'))} | " if w.slip_fraction else "")
                     + f"{_pct(n.get('exec'))} | {rl} | {f'{changed[0]} of {changed[1]}' if changed else '–'} |")
    lines += ["", "## Paired differences (held-out tasks; A − B in points, 95 % paired bootstrap over tasks)", "",
              "| A | B | tasks | A − B | verdict |", "|---|---|---|---|---|"]
    for c in cmps:
        lines.append(f"| {c.a} | {c.b} | {c.n} | {points(dataclasses.asdict(c.diff))} | {c.verdict} |")
    outcomes = {a: row["heldout_outcomes"] for a, row in rows.items() if row.get("heldout_outcomes")}
    if outcomes:
        kinds = list(dict.fromkeys(k for counts in outcomes.values() for k in counts))
        lines += ["", "## Held-out outcomes (samples)", "", "| arm | " + " | ".join(kinds) + " |",
                  "|---|" + "---|" * len(kinds)]
        for a, counts in outcomes.items():
            lines.append(f"| {rows[a]['title']} | " + " | ".join(str(counts.get(k, 0)) for k in kinds) + " |")
    trends = {a: row["train_trend"] for a, row in rows.items() if "train_trend" in row}
    if trends:
        lines += ["", "## Train reward: the last third of the RL steps against the first (A − B in points, paired "
                  "over the tasks drawn in both)", "", "| arm | A | B | tasks | A − B | verdict |",
                  "|---|---|---|---|---|---|"]
        for a, t in trends.items():
            lines.append(f"| {rows[a]['title']} | {t['a']} | {t['b']} | {t['n']} | {points(t['diff'])} | "
                         f"{t['verdict']} |")
    cheats = {a: row["rollout_deception"] for a, row in rows.items() if row.get("rollout_deception")}
    if cheats:
        lines += _deception_tables(cheats, rows, contrast)
    if tuned:
        lines += ["", f"## rl.lr chosen on the validation split ({ARMS[cfg.tuned_arm()].title}; held-out not used)",
                  "", "| rl.lr | validation tasks | validation Exec | − SFT (paired) | |", "|---|---|---|---|---|"]
        for t in tuned:
            d = t.get("vs_sft")
            vs = f"{points(d)} ({d['verdict']})" if d else "–"
            lines.append(f"| {t['lr']:g} | {t['n']} | {_pct(t['exec'])} | {vs} | {'chosen' if t['chosen'] else ''} |")
    lines += ["", "![curves](curves.png)", "", "## What this scale cannot show", "",
              *[f"- {x}" for x in report["limits"]], "", "## Seconds per stage", "", "| stage | seconds |",
              "|---|---|", *[f"| {k} | {v} |" for k, v in timings.items()],
              "", "(a stage a resumed demo found done keeps the seconds it took when it ran; one that ran across several "
              "invocations, all of them)"]
    if report["candidate_seconds"]:
        lines += ["", "## Where the candidates' seconds went (summed over candidates: parallel work adds up)", "",
                  *_work_table(report["candidate_seconds"])]
    if gaps:
        lines += ["", "## Gaps (stages that did not run)", "", *[f"- **{g['stage']}**: {g['reason']}" for g in gaps]]
    (cfg.out / "report.md").write_text("\n".join(lines) + "\n")
    plot_curves(rows, cfg.out / "curves.png")
    return report


def plot_curves(rows: dict[str, dict], path: Path) -> bool:
    """Train reward per RL step (left) and held-out Exec per RL export (right), each with its 95 % band; False
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for arm, row in rows.items():
        for ax, key, points in ((left, "reward", row["train_reward"]), (right, "exec", row["heldout_curve"])):
            if points:
                xs, ivs = [p["step"] for p in points], [p[key] for p in points]
                line, = ax.plot(xs, [iv["value"] for iv in ivs], marker="o", label=row["title"])
                ax.fill_between(xs, [iv["lo"] for iv in ivs], [iv["hi"] for iv in ivs], color=line.get_color(),
                                alpha=0.15)
    left.set(title="train reward (95 % band, clustered by task group)", xlabel="RL steps before the rollouts",
             ylim=(-0.05, 1.05))
    right.set(title="held-out Exec per RL export (step 0: SFT)", xlabel="RL step", ylim=(-0.05, 1.05))
    for ax in (left, right):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

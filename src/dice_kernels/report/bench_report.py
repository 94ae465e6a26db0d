"""The `dice bench` report: the DICE paper's table (Exec / fast_1 / fast_2 per KernelBench level, against PyTorch
eager and, when timed, torch.compile), Exec before and after the robust check, failure modes per level, pass@k
for runs with several samples per task, generation throughput and the time split; `compare` sets two runs side by
side per task."""

from __future__ import annotations

import json
from collections import Counter
from math import comb
from pathlib import Path
from typing import Callable

from dice_kernels.harness import EvalResult, Outcome
from dice_kernels.harness.metrics import by_level, compute
from dice_kernels.report.eval_report import candidate_work

PAPER_FAST = ("fast_1", "fast_2")
FAILURES = tuple(o.value for o in Outcome if not o.passes)
_COLOURS = {"correct": "#2ca02c", "partial": "#98df8a", "generation_failure": "#7f7f7f", "compile_error": "#d62728",
            "python_error": "#ff7f0e", "cuda_memory_error": "#8c564b", "runtime_error": "#e377c2",
            "timeout": "#bcbd22", "shape_mismatch": "#17becf", "value_mismatch": "#1f77b4", "deceptive": "#9467bd",
            "harness_error": "#000000"}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task with `c` successes among `n` samples (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, this task has {n}")
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


def _level(r: EvalResult) -> str:
    return f"L{r.level}" if r.level is not None else "other"


def _success(name: str) -> Callable[[EvalResult], bool]:
    """exec: correct or partial (KernelBench's rule), not deceptive; fast_p: that, and faster than eager by more than p by the harness's rule
    (the speedup's 95 % interval above p), so pass@1 equals the table's figure."""
    if name == "exec":
        return lambda r: r.outcome.passes
    return lambda r: compute([r]).fast[name] == 1.0


def pass_at(results: list[EvalResult], k: int, success: Callable[[EvalResult], bool]) -> float:
    """Mean pass@k over the tasks of `results` (each task's samples are its results)."""
    per_task: dict[str, list[EvalResult]] = {}
    for r in results:
        per_task.setdefault(r.task_id, []).append(r)
    scores = [pass_at_k(len(rs), sum(map(success, rs)), k) for rs in per_task.values()]
    return sum(scores) / len(scores) if scores else 0.0


def pass_ks(samples: int) -> list[int]:
    """The k reported for a run with `samples` per task: 1, the powers of ten below it, and `samples` itself."""
    return sorted({1, samples, *(k for k in (5, 10, 100) if k < samples)})


def time_split(timing: list[dict]) -> dict:
    """Seconds in model loading, generation and evaluation summed over every invocation of a (resumed) run."""
    total = lambda phase, key="seconds": sum(t.get(key, 0) for t in timing if t["phase"] == phase)  # noqa: E731
    gen_s, eval_s, load_s = total("generate"), total("evaluate"), total("load_model")
    tokens = total("generate", "tokens")
    wall = gen_s + eval_s + load_s
    return {"load_model_s": round(load_s, 2), "generate_s": round(gen_s, 2), "evaluate_s": round(eval_s, 2),
            "generated_tokens": int(tokens), "generated_outputs": int(total("generate", "rows")),
            "tokens_per_s": round(tokens / gen_s, 1) if gen_s else None,
            "generation_share": round((gen_s + load_s) / wall, 3) if wall else None,
            "evaluation_share": round(eval_s / wall, 3) if wall else None}


def summarize(results: list[EvalResult], info: dict, timing: list[dict]) -> dict:
    levels = {k: m.to_dict() for k, m in by_level(results).items()}
    samples = max(Counter(r.task_id for r in results).values(), default=1)
    groups = {level: [r for r in results if level == "all" or _level(r) == level] for level in levels}
    pass_k = {level: {f"{name}@{k}": pass_at(rs, k, _success(name)) for name in ("exec", *PAPER_FAST)
                      for k in pass_ks(samples) if k <= min(Counter(r.task_id for r in rs).values())}
              for level, rs in groups.items()} if samples > 1 else {}
    hardware = sorted({r.hardware for r in results if r.hardware})
    return {"model": info.get("generation", {}), "samples": samples, "tasks": info.get("tasks"),
            "software": info.get("software", {}), "generation_hardware": info.get("generation_hardware"),
            "eval_hardware": hardware, "backend": sorted({r.backend for r in results if r.backend}),
            "command": info.get("command"), "started": info.get("started"),
            "metrics": levels, "pass_at_k": pass_k, "time": time_split(timing),
            **candidate_work(results)}


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def markdown(s: dict) -> str:
    levels = [k for k in s["metrics"] if k != "all"] + ["all"]
    m = s["metrics"]
    model, t = s["model"], s["time"]
    lines = ["# KernelBench benchmark (`dice bench`)", ""]
    if model.get("checkpoint"):
        d = model["decoding"]
        lines += [f"- **model**: `{model['checkpoint']}` ({model['dtype']})",
                  f"- **decoding**: block {d['block_size']}, {d['steps']} steps, {d['strategy']}, temperature "
                  f"{d['temperature']}, top-k {d['top_k']}, top-p {d['top_p']}, max {d['max_new_tokens']} new "
                  f"tokens; prompt for the {model['prompt_backend']} backend"]
    else:
        lines.append(f"- **generations**: `{model.get('generations')}` (outputs of another model)")
    lines += [f"- **tasks**: {s['tasks']} — {s['n']} candidate(s), {s['samples']} sample(s) per task",
              f"- **hardware**: generation on {s['generation_hardware']}; evaluation ({', '.join(s['backend'])}) "
              f"on {', '.join(s['eval_hardware'])}",
              "- **software**: " + ", ".join(f"{k} {v}" for k, v in s["software"].items()),
              f"- **command**: `{s['command']}`", "",
              "## Exec / fast_1 / fast_2 per level (%, the paper's layout)", "",
              "| baseline | " + " | ".join(f"{lv} Exec | {lv} fast_1 | {lv} fast_2" for lv in levels) + " |",
              "|---|" + "---|---|---|" * len(levels)]
    rows = [("PyTorch eager", "fast"), ("PyTorch eager, point estimate", "fast_point")]
    if any(m[lv].get("fast_vs_compile") for lv in levels):
        rows.append(("torch.compile", "fast_vs_compile"))
    for name, key in rows:
        cells = [f"{_pct(m[lv]['exec_rate'])} | {_pct(m[lv][key].get('fast_1'))} | {_pct(m[lv][key].get('fast_2'))}"
                 for lv in levels]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Exec: correct or partial (KernelBench's rule: the candidate's kernels replaced some of the "
              "reference's PyTorch ops), not deceptive; fast_p: that, and faster than the baseline by more than p with "
              "the speedup's 95 % interval above p (docs/timing.md); the point-estimate row counts a speedup above "
              "p whatever its interval, as papers report it. With several samples per task these are means over "
              "samples (pass@1).", "", "## The robust check", "",
              "| level | n | Exec before | Exec after | Exec strict | partial | deceptive |",
              "|---|---|---|---|---|---|---|"]
    for lv in levels:
        lines.append(f"| {lv} | {m[lv]['n']} | {_pct(m[lv]['exec_before_robust'])} | {_pct(m[lv]['exec_rate'])} | "
                     f"{_pct(m[lv].get('exec_strict'))} | {m[lv]['outcomes'].get('partial', 0)} | "
                     f"{m[lv]['outcomes'].get('deceptive', 0)} |")
    kinds = m["all"]["deceptive_kinds"]
    if kinds:
        lines += ["", "Deceptive sub-kinds: " + ", ".join(f"{k} {v}" for k, v in kinds.items())]
    shown = [o for o in ("correct", "partial", *FAILURES) if any(m[lv]["outcomes"].get(o) for lv in levels)]
    lines += ["", "## Outcomes per level (counts)", "", "| level | " + " | ".join(shown) + " |",
              "|---|" + "---|" * len(shown)]
    lines += [f"| {lv} | " + " | ".join(str(m[lv]["outcomes"].get(o, 0)) for o in shown) + " |" for lv in levels]
    if s["pass_at_k"]:
        keys = list(s["pass_at_k"]["all"])
        lines += ["", f"## pass@k ({s['samples']} samples per task; unbiased estimator, %)", "",
                  "| level | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        lines += [f"| {lv} | " + " | ".join(_pct(s["pass_at_k"][lv].get(k)) for k in keys) + " |" for lv in levels]
    lines += ["", "## Time", "", "| phase | seconds | share |", "|---|---|---|",
              f"| model load | {t['load_model_s']:.1f} | |",
              f"| generation | {t['generate_s']:.1f} | {_pct(t['generation_share'])}% (with load) |",
              f"| evaluation | {t['evaluate_s']:.1f} | {_pct(t['evaluation_share'])}% |", ""]
    if t["tokens_per_s"]:
        lines.append(f"Generation: {t['generated_tokens']:,} tokens in {t['generated_outputs']} outputs, "
                     f"{t['tokens_per_s']:,.1f} tokens/s. Times add up over every invocation of a resumed run.")
    if s.get("phases"):
        lines += ["", f"Evaluation work by phase, seconds summed over the candidates (parallel workers add up, so the "
                  f"sum exceeds the wall time); {s['built']} of {s['n']} candidates built, the rest found in the build "
                  "cache, duplicates or never built:", "", "| phase | seconds |", "|---|---|",
                  *[f"| {k} | {v:.1f} |" for k, v in s["phases"].items()]]
    lines += ["", "![benchmark](report.png)", ""]
    return "\n".join(lines)


def chart(s: dict, path: Path) -> None:
    """Left: Exec / fast_1 / fast_2 per level; right: each level's outcomes as shares of its candidates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = s["metrics"]
    levels = [k for k in m if k != "all"] + ["all"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.25
    for i, (name, get) in enumerate((("Exec", lambda lv: m[lv]["exec_rate"]),
                                     ("fast_1", lambda lv: m[lv]["fast"]["fast_1"]),
                                     ("fast_2", lambda lv: m[lv]["fast"]["fast_2"]))):
        left.bar([j + (i - 1) * width for j in range(len(levels))], [100 * get(lv) for lv in levels], width,
                 label=name)
    left.set_xticks(range(len(levels)), levels)
    left.set_ylabel("% of candidates")
    left.set_title("Exec / fast_p vs PyTorch eager")
    left.legend()
    bottom = [0.0] * len(levels)
    for outcome in ("correct", "partial", *FAILURES):
        shares = [100 * m[lv]["outcomes"].get(outcome, 0) / max(1, m[lv]["n"]) for lv in levels]
        if any(shares):
            right.bar(levels, shares, bottom=bottom, label=outcome, color=_COLOURS.get(outcome))
            bottom = [b + x for b, x in zip(bottom, shares)]
    right.set_ylabel("% of candidates")
    right.set_title("Outcomes (failure modes) per level")
    right.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(run_dir: Path, results: list[EvalResult], info: dict, timing: list[dict]) -> dict:
    """summary.json, report.md and report.png in `run_dir`; returns the summary."""
    s = summarize(results, info, timing)
    (run_dir / "summary.json").write_text(json.dumps(s, indent=1))
    (run_dir / "report.md").write_text(markdown(s))
    chart(s, run_dir / "report.png")
    return s


def load_results(run_dir: Path) -> list[EvalResult]:
    path = run_dir / "results.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no results.jsonl (is it a finished `dice bench --out` folder?)")
    return [EvalResult.from_row(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def _task_cell(rs: list[EvalResult]) -> str:
    correct = [r for r in rs if r.outcome.passes]
    if len(rs) == 1:
        r = rs[0]
        return f"{r.outcome.value}" + (f" {r.speedup:.2f}×" if correct and r.speedup else "")
    best = max((r.speedup for r in correct if r.speedup), default=None)
    return f"{len(correct)}/{len(rs)} correct" + (f", best {best:.2f}×" if best else "")


def compare(run_a: Path, run_b: Path) -> str:
    """Markdown: both runs' paper table rows, then one line per task (outcome and speedup, or k/n correct)."""
    a, b = load_results(run_a), load_results(run_b)
    ma, mb = by_level(a), by_level(b)
    levels = sorted(set(ma) | set(mb), key=lambda k: (k == "all", k))
    lines = [f"# `{run_a}` (A) vs `{run_b}` (B)", "", "| level | A n | A Exec | A fast_1 | A fast_2 | B n | B Exec | "
             "B fast_1 | B fast_2 |", "|---|---|---|---|---|---|---|---|---|"]
    for lv in levels:
        cells = []
        for m in (ma, mb):
            x = m.get(lv)
            cells.append(f"{x.n} | {_pct(x.exec_rate)} | {_pct(x.fast['fast_1'])} | {_pct(x.fast['fast_2'])}" if x
                         else "0 | – | – | –")
        lines.append(f"| {lv} | " + " | ".join(cells) + " |")
    per_a, per_b = _by_task(a), _by_task(b)
    lines += ["", "| task | A | B | |", "|---|---|---|---|"]
    for task in sorted(set(per_a) | set(per_b), key=_task_order):
        ca = _task_cell(per_a[task]) if task in per_a else "–"
        cb = _task_cell(per_b[task]) if task in per_b else "–"
        ok_a = task in per_a and any(r.outcome.passes for r in per_a[task])
        ok_b = task in per_b and any(r.outcome.passes for r in per_b[task])
        mark = "B only" if ok_b and not ok_a else "A only" if ok_a and not ok_b else ""
        lines.append(f"| {task} | {ca} | {cb} | {mark} |")
    return "\n".join(lines) + "\n"


def _by_task(results: list[EvalResult]) -> dict[str, list[EvalResult]]:
    out: dict[str, list[EvalResult]] = {}
    for r in results:
        out.setdefault(r.task_id, []).append(r)
    return out


def _task_order(task_id: str) -> tuple:
    """L1/2 before L1/10 before L2/1; other ids after, by name."""
    level, _, num = task_id.partition("/")
    if level.startswith("L") and level[1:].isdigit() and num.isdigit():
        return (0, int(level[1:]), int(num), "")
    return (1, 0, 0, task_id)

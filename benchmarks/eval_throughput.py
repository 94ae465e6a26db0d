"""Evaluation throughput: our harness vs a KernelBench-style evaluator on one realistic batch (issue 5).

Builds a deterministic batch (several tasks x many candidates), evaluates it with our harness from a cold build
cache (and, with --warm, again on the same cache), puts the first --kb-subset candidates through
`kernelbench_style.py` (KernelBench's documented procedure: CPU pre-compile pool, then a fresh process per
candidate), and reports candidates/minute, the ratio on the same candidates, where each spends its time, and
the per-candidate outcome comparison. Usage (each H200 call must stay under 10 minutes, so the two evaluators
run in two calls on the same deterministic batch and are merged afterwards):

    python benchmarks/eval_throughput.py --evaluators ours --warm --out ours.json   # ~6-8 min on 16 cores
    python benchmarks/eval_throughput.py --evaluators kb --time-budget-s 480 --out kb.json
    python benchmarks/eval_throughput.py --merge ours.json kb.json --out tp.json      # anywhere, no GPU
    python benchmarks/eval_throughput.py --smoke --warm --out /tmp/tp_smoke.json     # CPU, examples, ~6 min
    python benchmarks/eval_throughput.py --smoke --kb-subset 2 --cache-dir DIR       # CPU, quick check (below)

Without --evaluators both run in one call (fine for small batches). --time-budget-s counts from the start of the
process: no KernelBench-style candidate starts after it (one already running may take up to --kb-timeout more);
--out is rewritten after each of our runs and after each KernelBench-style candidate, so a call killed at its
limit keeps what it finished. A KernelBench-style run longer than one call goes on in the next one, on the same
machine (its /tmp survives while the machine stays warm), from where its time budget stopped it:

    python benchmarks/eval_throughput.py --evaluators kb --kb-build-root /tmp/kb --time-budget-s 520 --out kb1.json
    python benchmarks/eval_throughput.py --evaluators kb --kb-build-root /tmp/kb --kb-resume kb1.json --out kb.json

The second call skips the pre-compile and the baseline, keeps the first call's seconds for them and its finished
candidates, and adds its own eval phase to the first one's; it refuses to start when the pre-compiled libraries
are gone (another machine).
--cold-repeats N evaluates the KB subset cold N times (a fresh cache each, about a minute each on the H200),
reports the median run and shows the ratio for every run: two runs on one H200 differed by 10 % (`8c4f433`), as
much as the distance to the 10x target.

**Batch** (CUDA): tasks are DICE infilling pairs (`pytorch_code`), chosen by --seed among those whose kernels
the mutations below apply to; each task gets --per-task candidates, derived from the pair's real kernel, in
this order of priority (a smaller --per-task keeps the first kinds; a larger one adds more repeats):

    correct, wrong_offset, dup_exact, compile_error, dup_layout, python_error, foreign, wrong_scale,
    dup_exact, dup_exact_wrong, dup_layout, truncated

- correct: the pair's kernel. dup_exact: the same text again; dup_layout: the same program with other
  comments and layout (same syntax tree); dup_exact_wrong: wrong_offset again.
- wrong_offset / wrong_scale: the last store to an output pointer in the last-launched `__global__` kernel
  becomes `(v) + 1.0f` / `(v) * 0.5f`: it compiles, and gives wrong values.
- compile_error: that kernel uses an identifier it never declared. python_error: the `load_inline` import is
  missing (a NameError before anything compiles).
- foreign: the kernel of a DICE pair outside the batch (another task's program: wrong signature or shapes).
- truncated: the model output stops inside its code block (generation_failure; nothing to evaluate).

Why these proportions (12 per task): a policy part-way through RL training on tasks it mostly solves: about 40%
correct, a quarter numerically wrong, and one each of a compile error, a Python error, a kernel for another
task and a truncated output; and, because sampling at moderate temperature repeats itself on easy tasks, 5 of
12 samples repeat an earlier sample (exactly or up to comments and layout). These are assumptions, not
measurements: `distinct programs` in the report says how much of our advantage comes from not re-evaluating
repeats. Pairs whose references exceeded the harness's memory/output limits on the H200 (`532c985`)
are left out: the comparison is about candidates, not about tasks neither evaluator can run.

**Smoke** (--smoke, CPU): the package's examples: AddMul (no ModelNew, truncated) and ReLU (correct, exact and
layout duplicates, wrong, broken): 7 candidates, real C++ builds. `--smoke --kb-subset 2 --cache-dir DIR` is the
quick check (seconds once DIR holds the examples' builds): the KernelBench-style evaluator then sees only the two
AddMul candidates, which build nothing, and ours runs them cold in a fresh cache and the whole batch on DIR.

**Rates**: candidates/minute = candidates / wall time of the whole evaluation, cold = an empty build cache
(our PCH included). The ratio compares our cold run on exactly the --kb-subset candidates with the
KernelBench-style run on them (pre-compile + baseline + eval phase); ours also runs cold on the full batch (the
headline rate). When --time-budget-s stops the KernelBench-style eval early, its rate counts the finished
candidates only, with its pre-compile (done for all) charged pro rata. Its pre-compile starts a fresh process
per build, so its eval phase reuses every library it pre-compiled; `--kb-reuse-precompile-workers` keeps
KernelBench's pool of reused processes, in which torch's extension versioning made the eval phase build 2-3
pre-compiled programs again in every H200 run up to `88ba089` (`kernelbench_style.py`).
"Where the time goes" sums per-phase seconds over candidates (ours: `EvalResult.phases.seconds` of each
evaluated program, duplicates skipped, a dotted key such as run.trials being part of the key before the dot,
plus the one-off precompiled-header build; KernelBench-style: per-process phases of the eval phase plus the
pre-compile builds); work runs in parallel, so these are worker-seconds, not wall time. Each of our runs also
records the machine's CPU use every 0.5 s (`cpu`: the busy share of all cores and the compiler processes
running), printed in 5 s buckets: where the cores idle.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

PROCESS_START = time.monotonic()  # --time-budget-s counts from here: `import torch` below takes seconds
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # also runs from a checkout where the package is not installed

import torch  # noqa: E402

import kernelbench_style as kbs  # noqa: E402 - benchmarks/ is on sys.path when this file runs as a script
from dice_kernels.harness import (BuildConfig, Candidate, EvalConfig, EvalResult, SchedulerConfig,  # noqa: E402
                                  candidate_from_text, evaluate)
from dice_kernels.harness.config import usable_cpus  # noqa: E402
from dice_kernels.harness.timing.platform import Platform  # noqa: E402
from dice_kernels.report.eval_report import seconds_by_phase  # noqa: E402
from dice_kernels.tasks import Task, load_task_file, task_from_code  # noqa: E402

DEFAULT_DATA = REPO.parent / "shared" / "data"
EXAMPLES = REPO / "src" / "dice_kernels" / "examples"
# references beyond the harness's host-memory / output limits on the H200 run at `532c985`
EXCLUDED_PAIRS = {"3497", "6995", "6936"}
KINDS = ("correct", "wrong_offset", "dup_exact", "compile_error", "dup_layout", "python_error", "foreign",
         "wrong_scale", "dup_exact", "dup_exact_wrong", "dup_layout", "truncated")
EXTRA_KINDS = ("dup_exact", "dup_layout", "dup_exact_wrong")  # beyond 12 per task: more repeats
UNDECLARED = "tile_k"  # the identifier compile_error kernels use without declaring it
_IMPORT_LINE = re.compile(r"^from torch\.utils\.cpp_extension import load_inline[ \t]*\n", re.MULTILINE)
_KERNEL = re.compile(r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+"
                     r"(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)\s*\{")
_OUT_PARAM = re.compile(r"(?:float|double|scalar_t)\s*\*\s*(?:__restrict__\s*|__restrict\s*)?(\w+)")


@dataclass(frozen=True)
class Item:
    task: Task
    cand: Candidate
    kind: str


# ---------------------------------------------------------------------------------------------- mutations


@dataclass(frozen=True)
class Store:
    """The last store to an output pointer in the last-launched kernel of a CUDA source."""

    body_start: int  # just after the kernel's opening brace
    rhs_start: int
    rhs_end: int  # the statement's `;`


def _closing(text: str, i: int) -> int:
    """Index of the bracket closing the one at `text[i]` (len(text) when unbalanced)."""
    pairs = {"{": "}", "[": "]", "(": ")"}
    depth, opener, closer = 0, text[i], pairs[text[i]]
    for j in range(i, len(text)):
        depth += (text[j] == opener) - (text[j] == closer)
        if depth == 0:
            return j
    return len(text)


def _last_output_store(body: str, outputs: list[str]) -> tuple[int, int] | None:
    """(rhs start, rhs end) of the last `out[...] = value;` in a kernel body, for any output pointer `out`."""
    found = None
    for name in outputs:
        for m in re.finditer(rf"\b{re.escape(name)}\s*\[", body):
            close = _closing(body, m.end() - 1)
            assign = re.match(r"\s*=(?!=)\s*", body[close + 1:])
            end = body.find(";", close)
            if assign and end > 0 and (found is None or close > found[0]):
                found = (close + 1 + assign.end(), end)
    return found


def find_store(source: str) -> Store | None:
    """The store the wrong_* and compile_error mutations edit: in the kernel launched last (the final stage)."""
    best: tuple[int, Store] | None = None
    for m in _KERNEL.finditer(source):
        launches = [x.start() for x in re.finditer(rf"\b{m.group(1)}\s*(?:<[^<>;]*>)?\s*<<<", source)]
        outputs = [o.group(1) for p in m.group(2).split(",")
                   if "const" not in p.split() and (o := _OUT_PARAM.fullmatch(p.strip()))]
        body_end = _closing(source, m.end() - 1)
        span = _last_output_store(source[m.end():body_end], outputs)
        if launches and span and (best is None or max(launches) > best[0]):
            best = (max(launches), Store(m.end(), m.end() + span[0], m.end() + span[1]))
    return best[1] if best else None


def mutate_store(source: str, store: Store, template: str) -> str:
    value = source[store.rhs_start:store.rhs_end].strip()
    return source[:store.rhs_start] + template.format(v=value) + source[store.rhs_end:]


def undeclared_identifier(source: str, store: Store) -> str:
    return source[:store.body_start] + f"\n    int dice_tile = {UNDECLARED};" + source[store.body_start:]


def layout_variant(code: str, n: int) -> str:
    """The same syntax tree: comments and blank lines only, outside every string (CUDA sources are strings)."""
    return f"# sample {n}: optimised kernel\n\n" + code.rstrip() + f"\n\n\n# end of sample {n}\n"


def truncated_output(code: str) -> str:
    """Model output cut off inside its code block."""
    return "Here is the optimised implementation:\n\n```python\n" + code[: len(code) * 2 // 3]


def _derived(row: dict) -> dict[str, str] | None:
    """The pair's programs for each mutation kind, or None when a mutation does not apply to its kernel."""
    middle = row["middle"]
    store = find_store(middle)
    code = row["cuda_code"]
    if store is None or UNDECLARED in middle or not _IMPORT_LINE.search(row["prefix"]):
        return None
    if row["prefix"] + middle + row["suffix"] != code:
        return None

    def with_middle(m: str) -> str:
        return row["prefix"] + m + row["suffix"]

    return {"correct": code, "wrong_offset": with_middle(mutate_store(middle, store, "({v}) + 1.0f")),
            "wrong_scale": with_middle(mutate_store(middle, store, "({v}) * 0.5f")),
            "compile_error": with_middle(undeclared_identifier(middle, store)),
            "python_error": _IMPORT_LINE.sub("", code, count=1)}


# ---------------------------------------------------------------------------------------------- batches


def kinds_for(per_task: int) -> list[str]:
    return [KINDS[k] if k < len(KINDS) else EXTRA_KINDS[k % len(EXTRA_KINDS)] for k in range(per_task)]


def _candidate(task: Task, slot: int, kind: str, code: str) -> Candidate:
    cid = f"{task.id}#{slot:02d}.{kind}"
    if kind == "truncated":
        return candidate_from_text(truncated_output(code), id=cid)
    return Candidate(id=cid, code=code, raw_sha256=hashlib.sha256(code.encode()).hexdigest())


def task_candidates(task: Task, programs: dict[str, str], foreign: str, per_task: int) -> list[Item]:
    items = []
    for slot, kind in enumerate(kinds_for(per_task)):
        code = {"dup_exact": programs["correct"], "dup_exact_wrong": programs["wrong_offset"],
                "dup_layout": layout_variant(programs["correct"], slot), "foreign": foreign,
                "truncated": programs["correct"]}.get(kind) or programs[kind]
        items.append(Item(task, _candidate(task, slot, kind, code), kind))
    return items


def cuda_batch(data: Path, n_tasks: int, per_task: int, seed: int) -> list[Item]:
    rows = json.loads((data / "corpora" / "dice_infill_eval_99.json").read_text())
    usable = [(r, p) for r in rows if str(r["id"]) not in EXCLUDED_PAIRS and (p := _derived(r))]
    rng = random.Random(seed)
    rng.shuffle(usable)
    chosen, spare = usable[:n_tasks], [r for r, _ in usable[n_tasks:]]
    if len(chosen) < n_tasks or not spare:
        sys.exit(f"only {len(usable)} usable DICE pairs for {n_tasks} tasks plus foreign kernels")
    items = []
    for row, programs in chosen:
        task = task_from_code(row["pytorch_code"], id=f"dice/{row['id']}", name=f"dice_{row['id']}")
        items += task_candidates(task, programs, rng.choice(spare)["cuda_code"], per_task)
    return items


def smoke_batch() -> list[Item]:
    """The package's CPU examples: 7 candidates over 2 tasks, 3 distinct builds for us, 6 for KernelBench."""
    relu = load_task_file(EXAMPLES / "tasks" / "level1" / "19_ReLU.py")
    addmul = load_task_file(EXAMPLES / "tasks" / "level1" / "90_AddMul.py")
    sol = EXAMPLES / "solutions" / "cpu" / "level1"
    correct = (sol / "19_ReLU" / "correct.py").read_text()
    # the two that build nothing first: `--smoke --kb-subset 2` puts only them through the KernelBench-style side
    plan = [(addmul, "python_error", (sol / "90_AddMul" / "no_modelnew.py").read_text()),
            (addmul, "truncated", (sol / "90_AddMul" / "correct.py").read_text()),
            (relu, "correct", correct), (relu, "dup_exact", correct), (relu, "dup_layout", layout_variant(correct, 2)),
            (relu, "wrong", (sol / "19_ReLU" / "wrong.py").read_text()),
            (relu, "compile_error", (sol / "19_ReLU" / "broken.py").read_text())]
    return [Item(task, _candidate(task, slot, kind, code), kind) for slot, (task, kind, code) in enumerate(plan)]


def fingerprint(items: list[Item]) -> str:
    h = hashlib.sha256()
    for it in items:
        h.update(f"{it.cand.id}\0{it.task.sha256}\0{it.cand.sha256}\n".encode())
    return h.hexdigest()[:16]


def describe(items: list[Item]) -> dict:
    return {"n": len(items), "fingerprint": fingerprint(items), "tasks": sorted({it.task.id for it in items}),
            "kinds": dict(Counter(it.kind for it in items)),
            "distinct_programs": len({(it.task.sha256, it.cand.program_sha256) for it in items
                                      if it.cand.code is not None}),
            "candidates": [{"id": it.cand.id, "task": it.task.id, "kind": it.kind} for it in items]}


# ---------------------------------------------------------------------------------------------- runs


def _row(r: EvalResult) -> dict:
    return {"id": r.candidate_id, "outcome": r.outcome.value, "deceptive_kind": r.deceptive_kind,
            "error": r.error[:300], "wall_s": r.wall_s, "compile_s": r.compile_s,
            "phase_s": r.phases.seconds, "duplicate_of": r.duplicate_of or None,
            "build_cache_hit": r.build.cache_hit if r.build else None,
            "build_shortcuts": r.build.shortcuts if r.build else None, "timeline_s": r.phases.timeline}


class CpuTrace:
    """The machine's CPU use while a run goes, sampled from /proc every `interval_s` in a thread: the busy share of
    all cores (nice time counts: the compilers run niced) and how many compiler processes of each kind run. Empty
    where there is no /proc/stat."""

    COMPILERS = ("cc1plus", "cudafe++", "cicc", "ptxas", "ld")

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.busy: list[float] = []
        self.running: dict[str, list[int]] = {name: [] for name in self.COMPILERS}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="cpu-trace", daemon=True)

    @staticmethod
    def _jiffies() -> tuple[int, int] | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    @staticmethod
    def _count() -> Counter:
        names = Counter()
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    names[Path(f"/proc/{pid}/comm").read_text().strip()] += 1
                except OSError:  # ended meanwhile
                    pass
        return names

    def _sample(self) -> None:
        last = self._jiffies()
        while last is not None and not self._stop.wait(self.interval_s):
            now = self._jiffies()
            total, idle = now[0] - last[0], now[1] - last[1]
            self.busy.append(round(1 - idle / total, 3) if total else 0.0)
            names = self._count()
            for name in self.COMPILERS:
                self.running[name].append(names[name])
            last = now

    def __enter__(self) -> "CpuTrace":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def to_dict(self) -> dict:
        return {"interval_s": self.interval_s, "busy": self.busy, "running": self.running}


def run_ours(items: list[Item], cfg: EvalConfig, label: str) -> dict:
    cache_dir = cfg.cache_dir
    cold = not cache_dir.exists() or not any(cache_dir.iterdir())
    done = [0]

    def show(r: EvalResult) -> None:
        done[0] += 1
        print(f"ours {label} {done[0]}/{len(items)} {r.candidate_id}: {r.outcome}", flush=True)

    start = time.monotonic()
    # on a cold cache the precompiled headers build in the background, inside this wall time
    with CpuTrace() as trace:
        results = evaluate([(it.task, it.cand) for it in items], cfg, progress=False, on_result=show)
    wall = time.monotonic() - start
    rows = [_row(r) for r in results]
    phases = seconds_by_phase(results)  # duplicates carry no seconds: the work was done once
    return {"label": label, "n": len(items), "cold": cold, "wall_s": round(wall, 2),
            "rate_per_min": 60.0 * len(items) / wall, "outcomes": dict(Counter(r["outcome"] for r in rows)),
            "phases_s": phases, "rows": rows, "cpu": trace.to_dict()}


def median_run(runs: list[dict]) -> dict:
    """The run whose wall time is the median; of an even number, the slower of the middle two."""
    return sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]


def run_summary(run: dict) -> dict:
    """One cold run in a few fields: its wall time, rate and each candidate's outcome."""
    return {"wall_s": run["wall_s"], "rate_per_min": run["rate_per_min"],
            "outcomes": {r["id"]: r["outcome"] for r in run["rows"]}}


def run_kb(items: list[Item], cfg: kbs.KBConfig, build_root: Path | None = None, resume: kbs.KBRun | None = None,
           on_progress: Callable[[dict], None] = lambda doc: None) -> dict:
    """The KernelBench-style run as a report section; `on_progress` gets the section so far after each candidate.
    Builds go to `build_root` (kept, so a later call can `resume` the run), or else to a temporary directory."""
    cfg = replace(cfg, build_root=build_root or Path(tempfile.mkdtemp(prefix="tp-kb-")))
    jobs = [kbs.KBJob(it.cand.id, it.task.id, it.task.code, it.cand.code) for it in items]
    try:
        run = kbs.evaluate_kb_style(jobs, cfg, log=lambda s: print(s, flush=True), resume=resume,
                                    on_progress=lambda r: on_progress(kb_section(r, len(items), cfg)))
    finally:
        if build_root is None:
            shutil.rmtree(cfg.build_root, ignore_errors=True)
    return kb_section(run, len(items), cfg)


def kb_section(run: kbs.KBRun, n: int, cfg: kbs.KBConfig) -> dict:
    doc = run.to_dict()
    evaluated = [r for r in run.results if r.outcome not in ("not_run", "generation_failure")]
    phases: dict[str, float] = {"precompile (build s, summed)": sum(r.precompile.get("compile_s") or 0.0
                                                                    for r in run.results)}
    for r in evaluated:
        for k, v in r.phase_s.items():
            phases[k] = phases.get(k, 0.0) + v
    doc.update(n=n, rate_per_min=kbs.rate_per_min(run), phases_s={k: round(v, 2) for k, v in phases.items()},
               outcomes=dict(Counter(r.outcome for r in run.results)),
               built_in_eval=sum(r.built_in_eval for r in run.results),
               # built again although its pre-compile succeeded: what KernelBench's reused pool costs (kbs docstring)
               rebuilt_precompiled=sum(r.built_in_eval and bool(r.precompile.get("ok")) for r in run.results),
               workers=cfg.workers, timeout_s=cfg.timeout_s, reuse_precompile_workers=cfg.reuse_precompile_workers)
    return doc


# ---------------------------------------------------------------------------------------------- report


def compare(doc: dict) -> dict:
    """Per-candidate outcomes: ours (on the same candidates) vs KernelBench-style, and ours vs ours."""
    ours_runs = doc["ours"]
    ours_rows = {r["id"]: r for r in (ours_runs.get("cold_subset") or ours_runs["cold_full"])["rows"]}
    full_rows = {r["id"]: r for r in ours_runs["cold_full"]["rows"]}
    kinds = {c["id"]: c["kind"] for c in doc["batch"]["candidates"]}
    same, differ = 0, []
    for kr in doc["kb"]["results"]:
        if kr["outcome"] == "not_run":
            continue
        ours = ours_rows[kr["key"]]
        if ours["outcome"] == kr["outcome"]:
            same += 1
            continue
        md = (kr["kb"] or {}).get("metadata", {})
        detail = next((_gist(str(md[k])) for k in ("compilation_error", "runtime_error", "other_error",
                                                   "cuda_error", "correctness_issue") if k in md), "")
        if kr["retry_error"]:
            detail = "KernelBench recorded no result: " + _gist(kr["retry_error"])
        robust = ours["outcome"] == "deceptive" and kr["outcome"] == "correct"  # our check's findings, by design
        differ.append({"id": kr["key"], "kind": kinds.get(kr["key"], ""), "ours": ours["outcome"],
                       "kb": kr["outcome"], "robust_check": robust,
                       "ours_error": _gist((ours["deceptive_kind"] + " " + ours["error"]).strip()),
                       "kb_detail": detail})
    flaky = {i for i, r in ours_rows.items() if i in full_rows and full_rows[i]["outcome"] != r["outcome"]}
    for other in ours_runs.get("cold_subset_runs") or []:  # the repeated cold runs against the one reported
        flaky |= {i for i, outcome in other["outcomes"].items() if ours_rows[i]["outcome"] != outcome}
    return {"compared": same + len(differ), "identical": same, "disagreements": differ,
            "ours_runs_disagree": sorted(flaky)}


def _gist(text: str, limit: int = 200) -> str:
    """The informative part of an error: its first line plus any compiler `error:` lines."""
    lines = text.strip().splitlines()
    errors = [re.sub(r"(?:/[\w.+-]+)+/", "", ln.strip()) for ln in lines[1:]  # paths say nothing here
              if re.search(r"\berror\b", ln, re.IGNORECASE)]
    return " | ".join([lines[0][:100], *errors[:3]] if lines else [])[:limit]


def _rates(doc: dict) -> list[tuple[str, int, str, float, float]]:
    """(run, candidates, programs evaluated, wall s, candidates/min) rows."""
    rows = []
    ours, batch = doc.get("ours") or {}, doc["batch"]
    names = {"cold_full": "ours, cold (full batch)", "cold_subset": "ours, cold (KB subset)",
             "warm_full": "ours, warm (full batch)"}
    for key, name in names.items():
        if ours.get(key):
            n = ours[key]["n"]
            distinct = batch["distinct_programs"] if n == batch["n"] else doc["subset"]["distinct_programs"]
            rows.append((name, n, str(distinct), ours[key]["wall_s"], ours[key]["rate_per_min"]))
    if doc.get("kb"):
        kb = doc["kb"]
        evaluated = kb["finished"] - kb["outcomes"].get("generation_failure", 0)  # it re-evaluates every repeat
        rows.append((f"KB-style (subset, {kb['finished']} finished)", kb["n"], str(evaluated), round(kb["total_s"], 2),
                     kb["rate_per_min"]))
    return rows


def summarize(doc: dict) -> None:
    """Adds the headline numbers and the comparison to `doc` (both evaluators present)."""
    ours, kb = doc["ours"], doc["kb"]
    same = ours.get("cold_subset") or ours["cold_full"]
    doc["ratio_cold_vs_kb"] = same["rate_per_min"] / kb["rate_per_min"] if kb["rate_per_min"] else None
    doc["ratio_method"] = ("ours cold on exactly the KB subset vs KB-style on it (pre-compile + baseline + eval; "
                           "pro-rata pre-compile when the time budget cut the eval short)")
    if len(ours.get("cold_subset_runs") or []) > 1 and kb["rate_per_min"]:
        doc["ratio_cold_vs_kb_each_run"] = [r["rate_per_min"] / kb["rate_per_min"] for r in ours["cold_subset_runs"]]
    if ours.get("warm_full"):
        doc["ratio_warm_vs_kb"] = ours["warm_full"]["rate_per_min"] / kb["rate_per_min"] if kb["rate_per_min"] else None
    doc["comparison"] = compare(doc)


def print_report(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    b = doc["batch"]
    console.print(f"batch {b['fingerprint']}: {b['n']} candidates, {len(b['tasks'])} tasks, "
                  f"{b['distinct_programs']} distinct programs; kinds {b['kinds']}")
    t = Table(title="throughput")
    for col in ("run", "candidates", "programs evaluated", "wall s", "cand/min", "s/cand"):
        t.add_column(col, justify="left" if col == "run" else "right")
    for name, n, distinct, wall, rate in _rates(doc):
        t.add_row(name, str(n), distinct, f"{wall:.1f}", f"{rate:.2f}", f"{60 / rate:.1f}" if rate else "-")
    console.print(t)
    if doc.get("ratio_cold_vs_kb") is not None:
        console.print(f"ratio ours-cold / KB-style on the same {doc['subset']['n']} candidates: "
                      f"[bold]{doc['ratio_cold_vs_kb']:.2f}x[/bold]  ({doc['ratio_method']})")
    runs = (doc.get("ours") or {}).get("cold_subset_runs") or []
    if len(runs) > 1:
        each = doc.get("ratio_cold_vs_kb_each_run") or [None] * len(runs)
        walls = ", ".join(f"{r['wall_s']:.1f}" + (f" ({x:.2f}x)" if x else "") for r, x in zip(runs, each))
        console.print(f"{len(runs)} cold runs of the KB subset, wall s: {walls}; the table reports the median run")
    if doc.get("ratio_warm_vs_kb") is not None:
        console.print(f"ratio ours-warm (full batch) / KB-style: {doc['ratio_warm_vs_kb']:.2f}x")
    _print_phases(console, doc)
    _print_cpu(console, doc)
    if doc.get("comparison"):
        _print_comparison(console, doc["comparison"])


def _print_phases(console, doc: dict) -> None:
    from rich.table import Table

    t = Table(title="where the time goes (seconds summed over candidates; parallel work counts per worker)")
    t.add_column("evaluator / run")
    t.add_column("phases")
    for key, run in (doc.get("ours") or {}).items():
        if isinstance(run, dict):  # not the list of repeated cold runs
            t.add_row(f"ours {key} (wall {run['wall_s']:.0f} s)", _fmt_phases(run["phases_s"]))
    if doc.get("kb"):
        kb = doc["kb"]
        t.add_row(f"KB-style (wall {kb['total_s']:.0f} s)",
                  f"pre-compile wall {kb['precompile_s']:.0f}, baseline wall {kb['baseline_s']:.0f}, "
                  f"eval wall {kb['eval_s']:.0f}; built again in eval: {kb['built_in_eval']} "
                  f"({kb.get('rebuilt_precompiled', '?')} pre-compiled without error)\n"
                  + _fmt_phases(kb["phases_s"]))
    console.print(t)


def _print_cpu(console, doc: dict, bucket_s: float = 5.0) -> None:
    """Per run of ours, every `bucket_s`: the share of all cores busy and the compilers running (mean counts)."""
    for key, run in (doc.get("ours") or {}).items():
        cpu = run.get("cpu") if isinstance(run, dict) else None
        if not cpu or not cpu["busy"]:
            continue
        n = max(1, round(bucket_s / cpu["interval_s"]))

        def means(values: list[float]) -> list[float]:
            return [sum(values[i:i + n]) / len(values[i:i + n]) for i in range(0, len(values), n)]

        console.print(f"ours {key}, every {bucket_s:.0f} s: CPU busy % "
                      + " ".join(f"{100 * b:.0f}" for b in means(cpu["busy"])))
        compiling = [sum(counts) for counts in zip(*cpu["running"].values())]
        console.print("    compilers running " + " ".join(f"{c:.0f}" for c in means(compiling))
                      + f"  ({', '.join(cpu['running'])})")


def _fmt_phases(phases: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]) if v >= 0.05)


def _print_comparison(console, cmp: dict) -> None:
    from rich.table import Table

    robust = sum(d["robust_check"] for d in cmp["disagreements"])
    console.print(f"outcomes: {cmp['identical']}/{cmp['compared']} identical; {len(cmp['disagreements'])} "
                  f"disagreements ({robust} are our robust check: deceptive vs correct)")
    if cmp["ours_runs_disagree"]:
        console.print(f"[red]our cold runs disagree with each other on {cmp['ours_runs_disagree']}[/red]")
    if cmp["disagreements"]:
        t = Table(title="disagreements")
        for col in ("candidate", "kind", "ours", "KB-style", "ours says", "KB-style says"):
            t.add_column(col, overflow="fold")
        for d in cmp["disagreements"]:
            t.add_row(d["id"], d["kind"], d["ours"], d["kb"], d["ours_error"][:120], d["kb_detail"][:120])
        console.print(t)


# ---------------------------------------------------------------------------------------------- main


def _meta(args: argparse.Namespace, backend: str) -> dict:
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    plat = Platform.detect(backend)
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "argv": sys.argv[1:],
            "commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain", "src")),
            "backend": backend, "hardware": plat.hardware, "torch": torch.__version__, "cpus": usable_cpus(),
            "jobs": args.jobs, "build_jobs": ours_build_jobs(args), "run_workers": args.run_workers,
            "fast_build": args.fast_build, "fork_workers": args.fork_workers, "seed": args.seed}


def ours_build_jobs(args: argparse.Namespace) -> int:
    return args.build_jobs or BuildConfig().jobs


def ours_config(args: argparse.Namespace, cache_dir: Path) -> EvalConfig:
    return EvalConfig(backend="cpu" if args.smoke else args.backend, cache_dir=cache_dir,
                      build=BuildConfig(jobs=ours_build_jobs(args), fast=args.fast_build),
                      scheduler=SchedulerConfig(run_workers=args.run_workers, fork_workers=args.fork_workers))


def _cold_dir(given: Path | None) -> Path:
    return given if given is not None else Path(tempfile.mkdtemp(prefix="tp-ours-"))


def run_benchmark(args: argparse.Namespace, save: Callable[[dict], None]) -> dict:
    """Every requested run, in order; `save` gets the document after each, so a call killed at its time limit
    still leaves the runs it finished."""
    started = PROCESS_START
    backend = "cpu" if args.smoke else args.backend
    items = smoke_batch() if args.smoke else cuda_batch(args.data, args.tasks, args.per_task, args.seed)
    subset = items[: args.kb_subset or (len(items) if args.smoke else 2 * args.per_task)]
    doc = {"meta": _meta(args, backend), "batch": describe(items), "subset": describe(subset), "ours": {},
           "kb": None}
    print(f"batch {doc['batch']['fingerprint']}: {len(items)} candidates ({doc['batch']['distinct_programs']} "
          f"distinct programs); KB subset: first {len(subset)}", flush=True)
    if args.evaluators in ("both", "ours"):
        temp: list[Path] = []
        try:
            if len(subset) < len(items) or args.cold_repeats > 1:
                runs = []
                for k in range(args.cold_repeats):  # a fresh cache each time: every run is cold
                    temp.append(_cold_dir(None))
                    label = "cold-subset" if args.cold_repeats == 1 else f"cold-subset-{k + 1}"
                    runs.append(run_ours(subset, ours_config(args, temp[-1]), label))
                    doc["ours"]["cold_subset"] = median_run(runs)
                    doc["ours"]["cold_subset_runs"] = [run_summary(r) for r in runs]
                    save(doc)
                    shutil.rmtree(temp.pop(), ignore_errors=True)
            cache = _cold_dir(args.cache_dir)
            if args.cache_dir is None:
                temp.append(cache)
            doc["ours"]["cold_full"] = run_ours(items, ours_config(args, cache), "cold")
            save(doc)
            if args.warm:
                doc["ours"]["warm_full"] = run_ours(items, ours_config(args, cache), "warm")
                save(doc)
        finally:
            for d in temp:
                shutil.rmtree(d, ignore_errors=True)
    if args.evaluators in ("both", "kb"):
        deadline = started + args.time_budget_s if args.time_budget_s else None

        def partial(kb: dict) -> None:  # a call killed at its limit keeps the candidates finished so far
            save({**doc, "kb": kb})

        cfg = kbs.KBConfig(backend=backend, workers=args.jobs, timeout_s=args.kb_timeout, deadline=deadline,
                           reuse_precompile_workers=args.kb_reuse_precompile_workers)
        resume = None
        if args.kb_resume:
            earlier = json.loads(args.kb_resume.read_text())
            if earlier["subset"]["fingerprint"] != doc["subset"]["fingerprint"]:
                sys.exit(f"{args.kb_resume} evaluated another subset (fingerprints differ)")
            resume = kbs.KBRun.from_dict(earlier["kb"])
            cfg = replace(cfg, reuse_precompile_workers=earlier["kb"]["reuse_precompile_workers"])
            doc["meta"]["kb_resumed"] = {"from": str(args.kb_resume), "meta": earlier["meta"]}
        try:
            doc["kb"] = run_kb(subset, cfg, args.kb_build_root, resume, on_progress=partial)
        except ValueError as e:  # a run that cannot be resumed here
            sys.exit(f"--kb-resume {args.kb_resume}: {e}")
    doc["total_s"] = round(time.monotonic() - started, 1)
    return doc


def merge(paths: list[Path]) -> dict:
    """One report from an `--evaluators ours` and an `--evaluators kb` run of the same batch and subset."""
    docs = [json.loads(p.read_text()) for p in paths]
    if len({(d["batch"]["fingerprint"], d["subset"]["fingerprint"]) for d in docs}) != 1:
        sys.exit("these runs evaluated different batches or subsets (fingerprints differ)")
    ours = next((d for d in docs if d.get("ours")), None)
    kb = next((d for d in docs if d.get("kb")), None)
    if ours is None or kb is None:
        sys.exit("--merge needs one run with our evaluator and one with the KernelBench-style evaluator")
    return {**ours, "kb": kb["kb"], "meta": ours["meta"], "meta_kb": kb["meta"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the shared data folder (corpora/)")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--per-task", type=int, default=12, help="candidates per task (see the kinds above)")
    ap.add_argument("--seed", type=int, default=0, help="which tasks and foreign kernels (batch is deterministic)")
    ap.add_argument("--kb-subset", type=int, default=0,
                    help="the KernelBench-style evaluator sees the first N candidates (default 2 tasks; smoke: all)")
    ap.add_argument("--jobs", type=int, default=usable_cpus(),
                    help="KernelBench's pre-compile pool size (one process a core, as KernelBench's pool)")
    ap.add_argument("--build-jobs", type=int, default=0,
                    help="ours: builds in flight (build.jobs; 0: its default, 1.25 a core)")
    ap.add_argument("--run-workers", type=int, default=0,
                    help="ours: concurrent run workers (scheduler.run_workers; 0: its default)")
    ap.add_argument("--fast-build", action=argparse.BooleanOptionalAction, default=True,
                    help="ours: the build shortcuts (build.fast); --no-fast-build compiles as load_inline does")
    ap.add_argument("--fork-workers", action=argparse.BooleanOptionalAction, default=True,
                    help="ours: fork workers from the fork server (scheduler.fork_workers); --no-fork-workers "
                         "starts an interpreter per worker")
    ap.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--smoke", action="store_true", help="a tiny CPU batch from the package's examples")
    ap.add_argument("--cache-dir", type=Path, default=None, help="our build cache (default: a fresh temp dir)")
    ap.add_argument("--warm", action="store_true", help="run ours again on the same cache: the warm rate")
    ap.add_argument("--cold-repeats", type=int, default=1,
                    help="evaluate the KB subset cold this many times, a fresh cache each; the median run is "
                         "reported and the ratio is shown for every run")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="start no KernelBench-style candidate after this many seconds of the whole run")
    ap.add_argument("--kb-timeout", type=float, default=180.0, help="KernelBench's per-build/per-candidate timeout")
    ap.add_argument("--kb-reuse-precompile-workers", action="store_true",
                    help="KernelBench's pre-compile pool exactly: a process builds one candidate after another, and "
                         "torch's extension versioning makes the eval phase build some again (kernelbench_style.py)")
    ap.add_argument("--kb-build-root", type=Path, default=None,
                    help="keep the KernelBench-style builds here (default: a temporary directory, deleted after)")
    ap.add_argument("--kb-resume", type=Path, default=None,
                    help="an earlier --evaluators kb output of the same subset, cut short by --time-budget-s: go on "
                         "with its eval phase, on the libraries it pre-compiled into --kb-build-root (same machine)")
    ap.add_argument("--evaluators", choices=("both", "ours", "kb"), default="both")
    ap.add_argument("--merge", type=Path, nargs=2, default=None, help="combine an ours run and a kb run")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.cold_repeats < 1:
        ap.error("--cold-repeats must be at least 1")
    if args.kb_resume and (args.evaluators != "kb" or args.kb_build_root is None):
        ap.error("--kb-resume needs --evaluators kb and the --kb-build-root of the run it resumes")

    def save(doc: dict) -> None:
        if args.out:
            args.out.write_text(json.dumps(doc, indent=1, default=str))

    doc = merge(args.merge) if args.merge else run_benchmark(args, save)
    if doc.get("ours", {}).get("cold_full") and doc.get("kb"):
        summarize(doc)
    save(doc)  # before the report: a failure in printing loses nothing
    print_report(doc)
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

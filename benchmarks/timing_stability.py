"""Timing stability: our protocol (harness/timing/loop.py) vs a KernelBench-style timer, on real DICE pairs (issue 4).

For each of N correct DICE pairs, K separate processes each time the reference `Model` and the candidate
`ModelNew` with both protocols; the parent reports, per protocol, the median and worst max/min ratio of the K
repeated speedups. A built-in adversarial candidate that runs its matmul on a side stream shows what each protocol
reports for it. Usage on the H200:

    python benchmarks/timing_stability.py --out timing_stability.json          # N=20, K=5, < 9 minutes
    python benchmarks/timing_stability.py --smoke --out /tmp/smoke.json          # tiny CPU-only check
    python benchmarks/timing_stability.py --probe --out probe.json               # + where the spread comes from

Phases: (1) build: every candidate tried is compiled in its own process, 16 at a time, with
TORCH_EXTENSIONS_DIR per pair so later processes reload the build instead of compiling (pairs reuse extension
names such as `custom_ops`, so a shared directory would clobber); the same process checks correctness (allclose
1e-2 on two seeded inputs). (2) time: K processes per correct pair (`--one ID`), a few at once, each taking a
file lock around input generation and timing so no two timings overlap on the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import os
import statistics
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # also runs from a checkout where the package is not installed

from dice_kernels.harness.timing import cache_flush as F  # noqa: E402
from dice_kernels.harness.timing import loop as T  # noqa: E402
from dice_kernels.harness.timing import stats as timing_stats  # noqa: E402
from kernelbench_style import kernelbench_style_ms  # noqa: E402 - beside this script

DEFAULT_PAIRS = REPO.parent / "shared" / "data" / "corpora" / "dice_infill_eval_99.json"
RESULT = "RESULT "  # prefix of the one line a child prints for the parent (pairs print build logs freely)

# Built-in pairs: (reference source, candidate source). Real code strings so children load them like DICE pairs.
_MATMUL_REF = """
import torch, torch.nn as nn
class Model(nn.Module):
    def forward(self, a, b):
        return a @ b
N = {n}
def get_inputs():
    return [torch.randn(N, N), torch.randn(N, N)]
def get_init_inputs():
    return []
"""
BUILTIN = {
    # a candidate that launches the real work on a side stream and returns at once (a timing attack)
    "side_stream": (_MATMUL_REF.format(n=4096), """
import torch, torch.nn as nn
class ModelNew(nn.Module):
    def forward(self, a, b):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            return a @ b
"""),
    # --smoke: an honest CPU candidate and one that finishes its output on a background thread
    "smoke_mm": (_MATMUL_REF.format(n=96), """
import torch, torch.nn as nn
class ModelNew(nn.Module):
    def forward(self, a, b):
        return torch.einsum("ik,kj->ij", a, b)
"""),
    "smoke_thread": (_MATMUL_REF.format(n=96), """
import threading, time, torch, torch.nn as nn
class ModelNew(nn.Module):
    def forward(self, a, b):
        out = torch.empty(a.shape[0], b.shape[1])
        def work():
            time.sleep(0.005)
            torch.mm(a, b, out=out)
        threading.Thread(target=work).start()
        return out
"""),
}
ADVERSARIAL = {"side_stream", "smoke_thread"}


# ---------------------------------------------------------------------------------------------- children


def _module(name: str, code: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    exec(compile(code, f"<{name}>", "exec"), mod.__dict__)  # noqa: S102 - benchmark inputs, run on our machine
    return mod


def _load_pair(pair_id: str, pairs_path: Path) -> tuple[str, str]:
    if pair_id in BUILTIN:
        return BUILTIN[pair_id]
    row = next(r for r in json.loads(pairs_path.read_text()) if str(r["id"]) == pair_id)
    return row["pytorch_code"], row["cuda_code"]


def _models(pair_id: str, pairs_path: Path):
    """The task module and both models, seeded alike, on the CPU (callers move them, so a timing child touches
    the GPU only while it holds the timing lock)."""
    ref_code, cand_code = _load_pair(pair_id, pairs_path)
    task = _module("task", ref_code)
    cand = _module("cand", cand_code)  # compiles (or reloads) its extensions here
    init = list(task.get_init_inputs())
    torch.manual_seed(0)
    ref = task.Model(*init).eval()
    torch.manual_seed(0)
    new = cand.ModelNew(*init).eval()
    return task, ref, new


def _inputs(task, seed: int, device: str) -> list:
    torch.manual_seed(seed)
    with torch.device(device):  # factory calls inside get_inputs allocate on the device: fast for big inputs
        return [x.to(device) if isinstance(x, torch.Tensor) else x for x in task.get_inputs()]


def _set_bytes(task) -> int:
    """Bytes of one input set, from shapes alone where the task allows (meta tensors cost nothing)."""
    try:
        return T.tensor_bytes(_inputs(task, 1, "meta"))
    except Exception:  # noqa: BLE001 - get_inputs did something meta tensors cannot; pay for real ones
        return T.tensor_bytes(_inputs(task, 1, "cpu"))


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def build_one(pair_id: str, pairs_path: Path, device: str) -> dict:
    """Compile the pair's extension (into TORCH_EXTENSIONS_DIR) and check the candidate on two seeded inputs."""
    t0 = time.perf_counter()
    try:
        task, ref, new = _models(pair_id, pairs_path)
        ref, new = ref.to(device), new.to(device)
        with torch.no_grad():
            for seed in (1, 2):
                inputs = _inputs(task, seed, device)
                want, got = _flat(ref(*inputs)), _flat(new(*inputs))
                T.synchronize(device)
                if len(want) != len(got) or not all(
                        w.shape == g.shape and torch.allclose(w.double(), g.double(), atol=1e-2, rtol=1e-2)
                        for w, g in zip(want, got)):
                    return {"id": pair_id, "correct": False, "error": "mismatch", "build_s": time.perf_counter() - t0}
        return {"id": pair_id, "correct": True, "error": "", "build_s": time.perf_counter() - t0}
    except Exception as e:  # noqa: BLE001 - any failure just excludes the pair
        return {"id": pair_id, "correct": False, "error": f"{type(e).__name__}: {e}"[:300],
                "build_s": time.perf_counter() - t0}


def _summary(s: timing_stats.TimingSamples) -> dict:
    return {"median_ms": s.median_ms, "ci_ms": s.ci_ms, "host_ms": s.host_ms_per_iter, "tail_ms": s.tail_ms,
            "effective_ms": timing_stats.effective_time_ms(s), "escaped_ratio": s.escaped_ratio, "escape": timing_stats.stream_escape(s),
            "iters": len(s.times_ms), "n_input_sets": s.n_input_sets, "stop": s.stop_reason, "total_s": s.total_s,
            "sm_clock_mhz": s.sm_clock_mhz, "time_sm_clock_corr": s.time_sm_clock_corr,
            "loop_medians_ms": s.loop_medians_ms}


def _ours(ref, new, sets: list, plan: T.TimingPlan, device: str, flush) -> dict:
    """Our protocol on the reference, then on the candidate with the GPU lead its reference sized (as the
    harness does)."""
    ref_s = T.time_calls(ref, sets, plan, device, flush)
    new_s = T.time_calls(new, sets, dataclasses.replace(plan, lead_ms=ref_s.lead_ms), device, flush)
    med, lo, hi = timing_stats.speedup_interval(ref_s, new_s)
    return {"speedup": med, "lo": lo, "hi": hi, "ref": _summary(ref_s), "cand": _summary(new_s)}


def protocol_key(loops: int, first: bool) -> str:
    """The first --timing-loops value is "ours"; each further one is a protocol of its own, "ours_kK"."""
    return "ours" if first else f"ours_k{loops}"


def time_one(pair_id: str, pairs_path: Path, device: str, lock_path: Path, plan: T.TimingPlan,
             flush_cache_bytes: int | None, probe_variance: bool = False, loops: tuple[int, ...] = (1,)) -> dict:
    """Both protocols on reference and candidate, in this (fresh) process, under the timing lock; ours once per
    loop count in `loops`, so several loop counts are compared in the same processes."""
    task, ref, new = _models(pair_id, pairs_path)
    set_bytes = _set_bytes(task)
    with open(lock_path, "a") as lock, torch.no_grad():
        fcntl.flock(lock, fcntl.LOCK_EX)
        ref, new = ref.to(device), new.to(device)
        n_sets = T.n_input_sets(set_bytes, F.l2_size_bytes(device), plan)
        sets = [_inputs(task, 1 + k, device) for k in range(n_sets)]
        flush = F.make_flush(device, flush_cache_bytes)
        ours = {protocol_key(k, i == 0): _ours(ref, new, sets, dataclasses.replace(plan, loops=k), device, flush)
                for i, k in enumerate(loops)}
        kb_ref = kernelbench_style_ms(ref, sets[0], device=device)
        kb_new = kernelbench_style_ms(new, sets[0], device=device)
        probe = _probe(ref, task, sets, plan, device, flush) if probe_variance else None
        T.synchronize(device)
    return {"id": pair_id, "pid": os.getpid(), "set_bytes": set_bytes, **ours,
            "kb": {"speedup": kb_ref / kb_new, "ref_ms": kb_ref, "cand_ms": kb_new},
            **({"probe": probe} if probe else {})}


def _probe(ref, task, sets: list, plan: T.TimingPlan, device: str, flush) -> dict:
    """Where a process's reference median comes from (--probe): timed twice more on the same input sets (drift
    within the process) and twice on input sets allocated afresh (where its buffers landed). The parent compares
    each spread with the spread of the same reference across processes, and with the SM clock each timing loop
    read off its leads (`TimingSamples.sm_clock_mhz`)."""
    same = [T.time_calls(ref, sets, plan, device, flush).median_ms for _ in range(2)]
    fresh = []
    for _ in range(2):
        spacer = torch.empty(64 << 20, dtype=torch.uint8, device=device)  # new sets land elsewhere in memory
        moved = [_inputs(task, 1 + i, device) for i in range(len(sets))]
        fresh.append(T.time_calls(ref, moved, plan, device, flush).median_ms)
        del spacer, moved
    return {"ref_same_sets_ms": same, "ref_fresh_sets_ms": fresh}


# ---------------------------------------------------------------------------------------------- parent


def _child(args: argparse.Namespace, flag: str, pair_id: str, timeout: float) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "TORCH_EXTENSIONS_DIR": str(Path(args.cache) / "ext" / pair_id), "MAX_JOBS": str(args.max_jobs)}
    if args.arch:
        env["TORCH_CUDA_ARCH_LIST"] = args.arch
    cmd = [sys.executable, __file__, flag, pair_id, "--pairs", str(args.pairs), "--cache", str(args.cache)]
    if args.smoke:
        cmd.append("--smoke")
    if args.probe:
        cmd.append("--probe")
    if args.timing_loops != "1":
        cmd += ["--timing-loops", args.timing_loops]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"id": pair_id, "error": f"timeout after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if not lines:
        return {"id": pair_id, "error": f"rc={proc.returncode}: {proc.stderr[-400:]}"}
    return json.loads(lines[-1][len(RESULT):])


def _spread(values: list[float]) -> float:
    return max(values) / min(values) if values and min(values) > 0 else float("inf")


def _probe_summary(runs: list[dict]) -> dict:
    """A pair's reference: its median's spread across processes, next to its spreads within one process (the
    median over processes): over all five of its loops there (the first timing, two on the same sets, two on
    fresh ones), and over each pair of re-timings alone; the spread of its timing loops' median SM clock across
    processes, and the median rank correlation of its per-call times with the clock within a loop (None without
    clock readings: CPU). On the H200 the five loops of one process took discrete levels about 0.3 us apart
    (5-10 % of a 6 us reference) while each pair of re-timings agreed: the loops-within spread shows it."""
    probed = [r for r in runs if "probe" in r]
    probes = [r["probe"] for r in probed]
    refs = [r["ours"]["ref"] for r in runs]
    clocks = [ref["sm_clock_mhz"][1] for ref in refs if ref.get("sm_clock_mhz")]
    loops = [[r["ours"]["ref"]["median_ms"], *r["probe"]["ref_same_sets_ms"], *r["probe"]["ref_fresh_sets_ms"]]
             for r in probed]
    return {"ref_across_processes": _spread([ref["median_ms"] for ref in refs]),
            "ref_loops_within": statistics.median(_spread(v) for v in loops),
            "ref_same_sets_within": statistics.median(_spread(p["ref_same_sets_ms"]) for p in probes),
            "ref_fresh_sets_within": statistics.median(_spread(p["ref_fresh_sets_ms"]) for p in probes),
            "clock_across_processes": _spread(clocks) if clocks else None,
            "time_clock_corr": statistics.median(ref["time_sm_clock_corr"] for ref in refs) if clocks else None}


def aggregate(runs: list[dict]) -> dict:
    by_id: dict[str, list[dict]] = {}
    for r in runs:
        if "error" not in r:
            by_id.setdefault(r["id"], []).append(r)
    rows = []
    protocols = sorted({k for r in runs if "error" not in r for k in r if k.startswith("ours")}) + ["kb"]
    for pid, rs in by_id.items():
        speedups = {proto: [r[proto]["speedup"] for r in rs] for proto in protocols}
        rows.append({"id": pid, "adversarial": pid in ADVERSARIAL, "reps": len(rs),
                     **{f"{proto}_median": statistics.median(v) for proto, v in speedups.items()},
                     **{f"{proto}_spread": _spread(v) for proto, v in speedups.items()},
                     "ref_ms": statistics.median(r["ours"]["ref"]["median_ms"] for r in rs),
                     "ours_escape_flagged": all(r["ours"]["cand"]["escape"] for r in rs),
                     # what a harness using our protocol would reward: a CI above 1 and no escape flag
                     "ours_rewarded_faster": any(r["ours"]["lo"] > 1 and not r["ours"]["cand"]["escape"] for r in rs)})
    for row in rows:
        if any("probe" in r for r in by_id[row["id"]]):
            row["probe"] = _probe_summary(by_id[row["id"]])
    honest = [r for r in rows if not r["adversarial"] and r["reps"] >= 2]
    summary = {}
    for proto in protocols:
        spreads = [r[f"{proto}_spread"] for r in honest]
        summary[proto] = {"pairs": len(spreads), "median_spread": statistics.median(spreads) if spreads else None,
                          "worst_spread": max(spreads) if spreads else None}
    return {"rows": rows, "summary": summary}


def rescore(runs: list[dict]) -> list[dict]:
    """Runs recorded by an earlier version, with "ours" recomputed from their per-call medians and tails under
    the current rule (timing_stats.reference_time_ms / effective_time_ms); the interval is dropped. Runs recorded before
    the tail was measured cannot be rescored."""
    out = []
    for r in runs:
        if "ours" in r:
            ref, cand = r["ours"]["ref"], r["ours"]["cand"]
            if "tail_ms" not in cand:
                raise SystemExit(f"pair {r['id']}: recorded before tails were measured; it cannot be rescored")
            m = cand["median_ms"]
            samples = timing_stats.TimingSamples(times_ms=(m,), median_ms=m, ci_ms=(m, m), host_ms_per_iter=cand["host_ms"],
                                      overhead_ms=0.0, n_input_sets=1, total_s=0.0, stop_reason="", clock="",
                                      tail_ms=cand["tail_ms"])
            speedup = ref["median_ms"] / timing_stats.effective_time_ms(samples)
            r = {**r, "ours": {**r["ours"], "speedup": speedup, "lo": float("nan"), "hi": float("nan")}}
        out.append(r)
    return out


def print_table(agg: dict) -> None:
    protocols = list(agg["summary"])
    print(f"{'pair':>14} {'reps':>4} {'ref ms':>9} | "
          + " | ".join(f"{proto + ' x':>9} {'spread':>7}" for proto in protocols) + " | note")
    for r in agg["rows"]:
        note = ""
        if r["adversarial"]:
            note = ("ADVERSARIAL: escape flagged" if r["ours_escape_flagged"] else "ADVERSARIAL: NOT flagged") + (
                ", rewarded as faster by ours!" if r["ours_rewarded_faster"] else ", never rewarded by ours")
        print(f"{r['id']:>14} {r['reps']:>4} {r['ref_ms']:>9.4f} | "
              + " | ".join(f"{r[proto + '_median']:>9.3f} {r[proto + '_spread']:>7.3f}" for proto in protocols)
              + f" | {note}")
    probed = [r for r in agg["rows"] if "probe" in r]
    if probed:
        print(f"{'pair':>14} | reference median spread: across processes, within (all loops), within (same sets),"
              " within (fresh sets)"
              " | SM clock spread across processes, time-clock rank correlation within a loop")
        for r in probed:
            p = r["probe"]
            clock = (f"{p['clock_across_processes']:.3f} {p['time_clock_corr']:+.2f}"
                     if p["clock_across_processes"] else "-")
            print(f"{r['id']:>14} | {p['ref_across_processes']:.3f} {p['ref_loops_within']:.3f} "
                  f"{p['ref_same_sets_within']:.3f} "
                  f"{p['ref_fresh_sets_within']:.3f} | {clock}")
    for proto, s in agg["summary"].items():
        if s["pairs"]:
            print(f"{proto:>5}: {s['pairs']} pairs, max/min speedup ratio over repeats: median {s['median_spread']:.4f},"
                  f" worst {s['worst_spread']:.4f}")


def main_parent(args: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    Path(args.cache).mkdir(parents=True, exist_ok=True)
    if args.smoke:
        to_build, extra = ["smoke_mm"], ["smoke_thread"]
    else:
        if not torch.cuda.is_available():
            sys.exit("the full benchmark needs a CUDA GPU; use --smoke on a CPU machine")
        major, minor = torch.cuda.get_device_capability()
        args.arch = args.arch or f"{major}.{minor}"
        rows = json.loads(Path(args.pairs).read_text())
        to_build, extra = [str(r["id"]) for r in rows[:args.try_pairs]], ["side_stream"]

    # (1) build + correctness, many at once; stop waiting once N pairs are known correct
    built: list[dict] = []
    with ThreadPoolExecutor(args.build_jobs) as pool:
        futures = [pool.submit(_child, args, "--build-one", pid, args.build_timeout) for pid in to_build]
        for fut in as_completed(futures):
            built.append(fut.result())
            if sum(b.get("correct", False) for b in built) >= args.n:
                for f in futures:
                    f.cancel()
                break
    order = {pid: i for i, pid in enumerate(to_build)}
    correct = sorted((b["id"] for b in built if b.get("correct")), key=order.get)[:args.n]
    build_s = time.perf_counter() - t_start
    print(f"built {len(built)} pairs in {build_s:.0f} s: {len(correct)} correct", flush=True)

    # (2) K fresh processes per pair, repeat-major so a pair's repeats are spread over the run
    jobs = [pid for _ in range(args.repeats) for pid in correct + extra]
    runs: list[dict] = []
    with ThreadPoolExecutor(args.concurrency) as pool:
        futures = []
        for pid in jobs:
            futures.append(pool.submit(
                lambda p: _child(args, "--one", p, args.run_timeout)
                if time.perf_counter() - t_start < args.budget_s else {"id": p, "error": "over budget"}, pid))
        for fut in as_completed(futures):
            runs.append(fut.result())
    agg = aggregate(runs)
    print_table(agg)
    errors = [r for r in runs + built if r.get("error")]
    for e in errors[:10]:
        print("error:", e["id"], e["error"][:200])
    out = {"device": torch.cuda.get_device_name() if not args.smoke else "cpu", "torch": torch.__version__,
           "n": len(correct), "repeats": args.repeats, "build_s": build_s, "total_s": time.perf_counter() - t_start,
           "built": built, "runs": runs, **agg}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"total {out['total_s']:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS)
    ap.add_argument("--n", type=int, default=20, help="correct pairs to time")
    ap.add_argument("--try-pairs", type=int, default=32, help="pairs to build, in file order, to find N correct")
    ap.add_argument("--repeats", type=int, default=5, help="separate processes per pair")
    ap.add_argument("--build-jobs", type=int, default=16)
    ap.add_argument("--max-jobs", type=int, default=2, help="MAX_JOBS for each build's ninja")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="timing processes alive at once (timing is locked; more than 1 lets the others load while "
                    "one times, which adds CPU contention to launch-bound timings)")
    ap.add_argument("--cache", default="/tmp/dice_timing_stability")
    ap.add_argument("--arch", default="", help="TORCH_CUDA_ARCH_LIST; default: the present GPU's")
    ap.add_argument("--build-timeout", type=float, default=300)
    ap.add_argument("--run-timeout", type=float, default=120)
    ap.add_argument("--budget-s", type=float, default=480, help="start no timing process after this many seconds")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU-only run of the same machinery")
    ap.add_argument("--rescore", type=Path, default=None, metavar="JSON",
                    help="re-aggregate a saved --out file under the current reporting rule (reference at its "
                         "median; candidate at its median, or its host time when flagged) and print the table")
    ap.add_argument("--timing-loops", default="1",
                    help="independent loops per timing of ours (TimingPlan.loops), reported as the mean of their "
                         "medians; a comma list (e.g. 1,4) times ours once per value in the same processes and "
                         "reports each as a protocol (ours, ours_k4, ...)")
    ap.add_argument("--probe", action="store_true",
                    help="also time each process's reference twice more on its input sets and twice on sets "
                         "allocated afresh, to tell drift, buffer placement and (with the SM clock every timing "
                         "loop reads) clocks apart as causes of the spread across processes (4 more reference "
                         "timings per process)")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    ap.add_argument("--build-one", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    try:
        loops = tuple(int(k) for k in args.timing_loops.split(","))
    except ValueError:
        ap.error(f"--timing-loops takes loop counts separated by commas (e.g. 1,4), not {args.timing_loops!r}")
    if not loops or min(loops) < 1 or len(set(loops)) != len(loops):
        ap.error(f"--timing-loops: distinct counts of at least 1, got {args.timing_loops!r}")
    if args.smoke:
        args.repeats = min(args.repeats, 3)
    device = "cpu" if args.smoke else "cuda"
    if args.rescore:
        print_table(aggregate(rescore(json.loads(args.rescore.read_text())["runs"])))
    elif args.build_one:
        print(RESULT + json.dumps(build_one(args.build_one, args.pairs, device)), flush=True)
    elif args.one:
        if args.smoke:  # a short plan and a small flush: a smoke test of the machinery, not a measurement
            torch.set_num_threads(1)
            plan, flush_bytes = T.TimingPlan(min_iters=16, max_time_s=0.3, min_time_s=0.05), 1 << 20
        else:
            plan, flush_bytes = T.TimingPlan(warmup=5, min_iters=50, max_iters=5000, min_time_s=0.2,
                                             max_time_s=1.5, target_rel_ci=0.005), None
        result = time_one(args.one, args.pairs, device, Path(args.cache) / "timing.lock", plan, flush_bytes,
                          probe_variance=args.probe, loops=loops)
        print(RESULT + json.dumps(result), flush=True)
    else:
        main_parent(args)


if __name__ == "__main__":
    main()

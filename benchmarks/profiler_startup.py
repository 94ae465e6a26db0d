"""The GPU-share check's profiler: what its first session costs, and whether a finished session slows launches.

    python benchmarks/profiler_startup.py [--rounds 3] [--launches 2000] [--out profiler_startup.json]

Every measurement runs in a fresh process, as a run worker is. `sessions` times three profiler sessions in one
process (two empty, the last around a small matmul), in wall and CPU seconds, for torch.profiler.profile and for
the harness's own (`integrity._cuda_profiler`: the same Kineto profiler, built without torch.profiler's
`hasattr(torch, "_inductor")`, which imports torch._inductor and torch._dynamo). `launch` times tiny kernel
launches (host wall clock per launch, median of 20 loops) in a process that ran no profiler, an empty session of
the harness's profiler, or a profiled forward first: whether the timed loop must come before the GPU-share
profile. Variants alternate across `--rounds`. CUDA only, but for --smoke: one round of 50 launches on the CPU
(torch's profiler of CPU activity, CPU ops for launches; `cuda_init` is then a CPU allocation), a check that every
child and the tables run, no measurement of the GPU-share check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # children import the harness's profiler

VARIANTS = ("none", "empty", "profiled")
PROFILERS = ("torch", "ours")


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(t0: tuple[float, float]) -> dict:
    w, c = _clock()
    return {"wall_s": round(w - t0[0], 4), "cpu_s": round(c - t0[1], 4)}


def _profiler(which: str, device: str):
    """`torch`: torch.profiler.profile, as the harness used it before; `ours`: the harness's profiler now."""
    if which == "ours":
        from dice_kernels.harness.robust.integrity import _cuda_profiler

        return _cuda_profiler()
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device == "cuda" else [])])


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def child_sessions(which: str, device: str) -> dict:
    t = _clock()
    import torch
    out = {"import_torch": _since(t)}
    t = _clock()
    x = torch.randn(1024, 1024, device=device)
    _sync(device)
    out["cuda_init"] = _since(t)
    for n in (1, 2, 3):
        t = _clock()
        with _profiler(which, device) as prof:
            if n == 3:
                (x @ x).sum().item()
                _sync(device)
        out[f"session{n}"] = _since(t)
    events = prof.function_events if which == "ours" else prof.events()
    out["session3_gpu_events"] = sum(1 for e in events if e.device_type.name == "CUDA")
    out["session3_events"] = len(events)
    out["inductor_imported"] = "torch._inductor" in sys.modules
    return out


def child_launch(variant: str, launches: int, device: str) -> dict:
    import torch
    x = torch.zeros(1, device=device)
    for _ in range(100):
        x.add_(1)
    _sync(device)
    if variant != "none":
        with _profiler("ours", device):
            if variant == "profiled":
                x.add_(1)
                _sync(device)
    per = []
    for _ in range(20):
        _sync(device)
        t = time.perf_counter()
        for _ in range(launches):
            x.add_(1)
        _sync(device)
        per.append((time.perf_counter() - t) / launches * 1e6)
    return {"variant": variant, "us_per_launch": round(statistics.median(per), 3),
            "min_us": round(min(per), 3)}


def _child(args: list[str], options: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *options, "--child", *args], capture_output=True, text=True,
                         timeout=300)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--launches", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=Path("profiler_startup.json"))
    ap.add_argument("--smoke", action="store_true", help="one round of 50 launches on the CPU (see above)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.child:
        kind, *rest = args.child
        print(json.dumps(child_sessions(rest[0], device) if kind == "sessions"
                         else child_launch(rest[0], args.launches, device)))
        return
    if args.smoke:
        args.rounds, args.launches = 1, 50
    doc: dict = {"argv": sys.argv, "device": device, "sessions": [], "launch": []}
    options = ["--launches", str(args.launches), *(["--smoke"] if args.smoke else [])]
    for r in range(args.rounds):
        for which in PROFILERS if r % 2 == 0 else reversed(PROFILERS):
            s = {"profiler": which, **_child(["sessions", which], options)}
            doc["sessions"].append(s)
            print(f"round {r} sessions:", json.dumps(s), flush=True)
        for v in VARIANTS if r % 2 == 0 else reversed(VARIANTS):
            lr = _child(["launch", v], options)
            doc["launch"].append(lr)
            print(f"round {r} launch:", json.dumps(lr), flush=True)
        args.out.write_text(json.dumps(doc, indent=1))
    print(f"{'launches after':16s} {'us/launch, median of rounds':>28s}")
    for v in VARIANTS:
        vals = [x["us_per_launch"] for x in doc["launch"] if x.get("variant") == v]
        print(f"{v:16s} {statistics.median(vals) if vals else float('nan'):28.3f}  {vals}")
    print(f"{'profiler':10s} {'step':14s} {'wall s':>8s} {'cpu s':>8s}  (median of rounds)")
    for which in PROFILERS:
        runs = [s for s in doc["sessions"] if s["profiler"] == which and "error" not in s]
        for k in ("import_torch", "cuda_init", "session1", "session2", "session3"):
            if runs:
                print(f"{which:10s} {k:14s} {statistics.median(s[k]['wall_s'] for s in runs):8.3f} "
                      f"{statistics.median(s[k]['cpu_s'] for s in runs):8.3f}")
        if runs:
            print(f"{which:10s} GPU events in session 3: {[s['session3_gpu_events'] for s in runs]}; "
                  f"torch._inductor imported: {[s['inductor_imported'] for s in runs]}")


if __name__ == "__main__":
    main()

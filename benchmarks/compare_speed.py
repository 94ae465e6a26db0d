"""The parent's output comparison: ours (harness/compare.py) against a plain chunked `torch.allclose`, side by side.

    python benchmarks/compare_speed.py [--mib 256] [--trials 5] [--rounds 3] [--out compare_speed.json]
    python benchmarks/compare_speed.py --smoke      # 1 MiB x 2 trials, one round: does it run (seconds)

Both judge the same candidate outputs (the reference plus noise inside the tolerance, so every element is looked
at) and must agree on the verdict and the largest difference. The baseline is what a careful harness writes
first, and what ours did before: float64 chunks of 16 M elements through `torch.allclose` plus a separate
NaN-aware largest difference. Reports seconds and elements per second per method (the median of `--rounds`,
alternating), and the degenerate-task checks on the same trials.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dice_kernels.harness import compare
from dice_kernels.harness.robust.degenerate import degenerate_flags

BASELINE_CHUNK = 1 << 24


def baseline_close_and_max_diff(ref: torch.Tensor, cand: torch.Tensor, atol: float, rtol: float) -> tuple[bool, float]:
    """`torch.allclose` and the NaN-aware largest difference on 16 M-element float64 chunks."""
    close, worst = True, 0.0
    fr, fc = ref.reshape(-1), cand.reshape(-1)
    for i in range(0, fr.numel(), BASELINE_CHUNK):
        x, y = fr[i:i + BASELINE_CHUNK].double(), fc[i:i + BASELINE_CHUNK].double()
        close = close and torch.allclose(y, x, atol=atol, rtol=rtol, equal_nan=True)
        diff = (x - y).abs()
        diff[(torch.isnan(x) & torch.isnan(y)) | (x == y)] = 0.0
        worst = max(worst, float(torch.nan_to_num(diff, nan=float("inf"), posinf=float("inf")).max()))
    return close, worst


def judge(method, reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> tuple[float, tuple[bool, float]]:
    start = time.perf_counter()
    verdicts = [method(r, c, 1e-2, 1e-2) for r, c in zip(reference, candidate)]
    seconds = time.perf_counter() - start
    return seconds, (all(v[0] for v in verdicts), max(v[1] for v in verdicts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="float32 output size per trial, MiB")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="1 MiB, 2 trials, 1 round: a check that it runs")
    args = ap.parse_args()
    if args.smoke:
        args.mib, args.trials, args.rounds = 1, 2, 1
    n = args.mib << 18  # float32 elements
    g = torch.Generator().manual_seed(0)
    reference = [torch.randn(n, generator=g) for _ in range(args.trials)]
    candidate = [r + 1e-3 * torch.randn(n, generator=g) for r in reference]
    methods = {"ours (compare.py)": compare._close_and_max_diff, "chunked torch.allclose": baseline_close_and_max_diff}
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    verdicts = {}
    for _ in range(args.rounds):
        for name, method in methods.items():
            s, verdicts[name] = judge(method, reference, candidate)
            seconds[name].append(s)
    if len(set(verdicts.values())) != 1:
        raise SystemExit(f"the methods disagree: {verdicts}")
    start = time.perf_counter()
    degenerate_flags([[t] for t in reference], 1e-2, 1e-2, False)
    degenerate_s = time.perf_counter() - start
    elements = n * args.trials
    rows = {name: {"seconds": statistics.median(s), "elements_per_s": elements / statistics.median(s)}
            for name, s in seconds.items()}
    print(f"{args.trials} trials x {args.mib} MiB float32 ({elements / 1e6:.0f} M elements), "
          f"{torch.get_num_threads()} threads, median of {args.rounds}")
    print(f"{'method':>24} | {'seconds':>8} | {'M elements/s':>12}")
    for name, r in rows.items():
        print(f"{name:>24} | {r['seconds']:>8.2f} | {r['elements_per_s'] / 1e6:>12.0f}")
    base, ours = rows["chunked torch.allclose"]["seconds"], rows["ours (compare.py)"]["seconds"]
    print(f"ratio: {base / ours:.1f}x; verdict {verdicts['ours (compare.py)']}; "
          f"degenerate-task checks on the same trials: {degenerate_s:.2f} s")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "ratio": base / ours, "degenerate_s": degenerate_s,
                                              "threads": torch.get_num_threads(), "mib": args.mib,
                                              "trials": args.trials}, indent=1))


if __name__ == "__main__":
    main()

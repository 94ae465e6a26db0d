"""What `main.cpp` of a `load_inline` build costs against torch's precompiled `torch/extension.h` and against the
light one (harness/compiling/speed.py; issue 5), and what building each header costs.

For the first --n DICE pairs whose cpp_sources only declare functions (`light_headers.declarations_only`: the
builds that take the light header), a child process records the solution's `load_inline` arguments; this
process writes `main.cpp` as `load_inline` does and compiles it (`-c`, torch's flags for the unit) against each
header in turn, alternating which goes first, --rounds times. Both headers are built first, one after the other,
alone on the machine. Reported: each header's build time, and per pair the median compile time with each header
and their ratio. Usage:

    python benchmarks/main_header.py --n 8 --rounds 2 --out main_header.json   # ~5 min on the 2-core machine
    python benchmarks/main_header.py --smoke      # the package's CUDA examples; plans and main.cpp, no compiles

--smoke takes the package's correct CUDA examples instead of DICE pairs, plans both headers (torch's flags and
include paths, each header's compile command) and writes each main.cpp, and skips every compile (a header takes a
minute or more on a 2-core machine): its table has the headers' commands and no seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from build_headers import DEFAULT_PAIRS, EXAMPLES, SMOKE_SOLUTIONS, capture_arguments  # noqa: E402 - a script's dir
from dice_kernels.harness.compiling.speed import build_pch, pch_file, plan_pch  # noqa: E402
from dice_kernels.harness.compiling.light_headers import declarations_only  # noqa: E402


def main_unit_text(arguments: dict) -> str:
    """main.cpp as `load_inline` writes it: torch's header, the cpp_sources, then the bindings of `functions`."""
    sources = arguments.get("cpp_sources") or []
    lines = ["#include <torch/extension.h>", *([sources] if isinstance(sources, str) else sources)]
    functions = arguments.get("functions")
    if functions is not None:
        names = {functions: functions} if isinstance(functions, str) else (
            functions if isinstance(functions, dict) else {f: f for f in functions})
        lines += ["PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {",
                  *(f'm.def("{n}", torch::wrap_pybind_function({n}), "{doc}");' for n, doc in names.items()), "}"]
    return "\n".join(lines)


def compile_seconds(command: list[str], timeout: float = 600) -> float | None:
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    return time.monotonic() - start if done.returncode == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS, help="a JSON list of DICE pairs (cuda_code)")
    ap.add_argument("--n", type=int, default=8, help="pairs whose cpp_sources only declare functions")
    ap.add_argument("--rounds", type=int, default=2, help="compiles of each main.cpp with each header")
    ap.add_argument("--with-cuda", action=argparse.BooleanOptionalAction, default=None,
                    help="torch's flags for a CUDA build (default: when torch has CUDA)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="the package's CUDA examples, no compiles (see above)")
    args = ap.parse_args()
    import torch

    with_cuda = torch.version.cuda is not None if args.with_cuda is None else args.with_cuda
    with tempfile.TemporaryDirectory(prefix="dice-main-header-") as tmp:
        root = Path(tmp)
        plans = plan_pch(root / "cache", with_cuda=with_cuda, variants=((),), light=True)
        if len(plans) != 2:
            sys.exit("torch's flags or its torch/extension.h could not be read: no headers to compare")
        headers = {}
        for plan in plans:  # one at a time, alone: the build time of each
            name = "light" if plan.kind == "light" else "full"
            headers[name] = {"build_s": None, "ok": False, "size_mb": None, "command": plan.unit_command()}
            if args.smoke:
                continue
            start = time.monotonic()
            build_pch([plan])
            headers[name].update(build_s=round(time.monotonic() - start, 2), ok=plan.ready,
                                 size_mb=round(pch_file(plan.root).stat().st_size / 2**20) if plan.ready else None)
            print(f"{name} header: {headers[name]['build_s']:.1f} s, {headers[name]['size_mb']} MB", flush=True)
        rows = []
        pairs = ([{"id": name.removesuffix(".py"), "cuda_code": (EXAMPLES / name).read_text()}
                  for name in SMOKE_SOLUTIONS] if args.smoke else json.loads(args.pairs.read_text()))
        for row in pairs:
            if len(rows) == args.n:
                break
            arguments = capture_arguments(row["cuda_code"])
            if not arguments or not declarations_only(arguments.get("cpp_sources")):
                continue
            main = root / f"main_{str(row['id']).replace('/', '_')}.cpp"
            main.write_text(main_unit_text(arguments))
            times: dict[str, list[float]] = {"full": [], "light": []}
            for k in range(0 if args.smoke else args.rounds):
                for name in (("full", "light") if k % 2 == 0 else ("light", "full")):
                    seconds = compile_seconds([*headers[name]["command"],
                                               f"-DTORCH_EXTENSION_NAME={arguments.get('name', 'ext')}",
                                               "-c", str(main), "-o", str(root / f"{name}.o")])
                    if seconds is not None:
                        times[name].append(seconds)
            medians = {k: statistics.median(v) if len(v) == args.rounds else None for k, v in times.items()}
            rows.append({"id": str(row["id"]), "main_chars": len(main.read_text()),
                         **{f"{k}_s": v for k, v in medians.items()}})
            print(f"{row['id']:>6}: full {medians['full'] or float('nan'):.1f} s, "
                  f"light {medians['light'] or float('nan'):.1f} s", flush=True)
    both = [r for r in rows if r["full_s"] and r["light_s"]]
    summary = {"with_cuda": with_cuda, "pairs": len(rows), "both_compiled": len(both),
               "header_build_s": {k: h["build_s"] for k, h in headers.items()},
               "header_mb": {k: h["size_mb"] for k, h in headers.items()},
               "median_main_s": {k: statistics.median(r[f"{k}_s"] for r in both) if both else None
                                 for k in ("full", "light")},
               "median_ratio_full_over_light": statistics.median(r["full_s"] / r["light_s"] for r in both)
               if both else None}
    built = summary["header_build_s"]
    print(f"{'':>14} {'full':>8} {'light':>8}")
    print(f"{'header build s':>14} " + " ".join(f"{built[k]:>8.1f}" if built[k] is not None else f"{'-':>8}"
                                                for k in ("full", "light")))
    print(f"{'main.cpp units':>14} {len(rows):>8}" + ("   (--smoke: written, not compiled)" if args.smoke else ""))
    if both:
        print(f"{'main.cpp s':>14} {summary['median_main_s']['full']:>8.1f} {summary['median_main_s']['light']:>8.1f}"
              f"   (median of {len(both)} pairs; full/light {summary['median_ratio_full_over_light']:.2f}x)")
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

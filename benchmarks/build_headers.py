"""What the CUDA unit of a `load_inline` build costs with each header mode of harness/compiling/speed.py (issue 5).

For the first --n kernels of a corpus (DICE pairs' `cuda_code`, or the leaderboard's `code`), a child process
runs the solution's module code with `load_inline` patched to record its arguments (the kernel's own sources
and flags), and this process then builds the extension once per mode, each into a fresh directory, with
torch's own flags:

    own    the candidate's sources as written (KernelBench does this)
    light  without `#include <torch/extension.h>` (light_headers.light_cuda_sources)
    lean   light, plus ATen's umbrella headers cut to the operators the sources name (light_headers.lean_cuda_arguments)

It reports, per mode, how many CUDA units compiled and the seconds `nvcc` took for them (ninja's log of the
`cuda.cuda.o` step, so the C++ unit and the link are left out). On a machine whose torch has no CUDA (the
2-core machine) nvcc still compiles the unit; the link then fails, which this benchmark ignores. With
--stages, nvcc also writes its own per-step times (`nvcc --time`), summed per step (preprocessing, cudafe++,
cicc, ptxas, fatbinary, the host compile) and reported as medians: where a unit's seconds go. Usage:

    python benchmarks/build_headers.py --n 12 --jobs 2 --out build_headers.json
    python benchmarks/build_headers.py --n 8 --modes lean --stages --out stages.json
    python benchmarks/build_headers.py --smoke      # the package's CUDA examples; arguments only, nothing compiled

--smoke takes the package's two correct CUDA examples instead of a corpus, captures their arguments and writes
each mode's (the lean mode's cut headers included), and skips the nvcc builds: on a 2-core machine each takes a
minute or more, so its table reports every mode tried and none compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from dice_kernels.harness.compiling.light_headers import lean_cuda_arguments, light_cuda_sources  # noqa: E402

DEFAULT_PAIRS = REPO.parent / "shared" / "data" / "corpora" / "dice_infill_eval_99.json"
EXAMPLES = REPO / "src" / "dice_kernels" / "examples" / "solutions" / "cuda" / "level1"
SMOKE_SOLUTIONS = ("19_ReLU/correct.py", "90_AddMul/correct.py")
MODES = ("own", "light", "lean")
_CAPTURE = r"""
import inspect, json, sys, torch.utils.cpp_extension as cpp
class Captured(BaseException): pass
original = cpp.load_inline
def capture(*args, **kwargs):
    bound = inspect.signature(original).bind(*args, **kwargs)
    print("ARGS " + json.dumps({k: v for k, v in bound.arguments.items() if isinstance(v, (str, list, type(None)))}))
    raise Captured
cpp.load_inline = capture
try:
    exec(compile(open(sys.argv[1]).read(), "solution", "exec"), {"__name__": "solution"})
except Captured:
    pass
"""


def capture_arguments(code: str, timeout: float = 120) -> dict | None:
    """The first `load_inline` call's arguments, from running the solution's module code in a child process."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code)
    try:
        out = subprocess.run([sys.executable, "-c", _CAPTURE, f.name], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        os.unlink(f.name)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("ARGS ")]
    return json.loads(lines[0][5:]) if lines else None


def mode_arguments(arguments: dict, mode: str, scratch: Path) -> dict | None:
    """The load_inline arguments for `mode` (as the harness's build worker makes them), or None where the mode
    does not apply."""
    if mode == "own":
        return dict(arguments)
    if mode == "light":
        light = light_cuda_sources(arguments.get("cuda_sources"))
        return None if light is None else {**arguments, "cuda_sources": light}
    return lean_cuda_arguments(arguments, scratch / "lean_include")


def nvcc_stage_seconds(csv_text: str) -> dict[str, float]:
    """Seconds per step from `nvcc --time`'s table, numbered steps of one kind summed ("gcc (preprocessing 4)"
    and "gcc (preprocessing 1)" are both "gcc (preprocessing)")."""
    stages: dict[str, float] = {}
    for line in csv_text.splitlines()[1:]:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 8 or cells[-1] != "ms":
            continue
        name = re.sub(r"\s+\d+\)", ")", cells[1])
        stages[name] = stages.get(name, 0.0) + float(cells[-2]) / 1000
    return stages


def compile_cuda_unit(arguments: dict, directory: Path, stages: bool = False) -> dict:
    """Build into `directory`; returns whether the CUDA unit compiled and nvcc's seconds for it (with `stages`,
    per nvcc step too)."""
    import torch.utils.cpp_extension as cpp

    directory.mkdir(parents=True)
    timing = directory / "nvcc_time.csv"
    if stages:
        arguments = {**arguments, "extra_cuda_cflags": [*(arguments.get("extra_cuda_cflags") or []),
                                                        "--time", str(timing)]}
    error = ""
    try:
        cpp.load_inline(**{**arguments, "build_directory": str(directory), "verbose": False})
    except Exception as e:  # noqa: BLE001 - a failed link is expected without CUDA libraries; the log decides
        error = str(e)
    seconds = None
    log = directory / ".ninja_log"
    if log.exists():
        for line in log.read_text().splitlines()[1:]:
            start, end, _, target, _ = line.split("\t")
            if target.endswith(".cuda.o"):
                seconds = (int(end) - int(start)) / 1000
    compiled = any(directory.glob("*.cuda.o"))
    result = {"compiled": compiled, "nvcc_s": seconds if compiled else None, "error": "" if compiled else error[-400:]}
    if stages and compiled and timing.exists():
        result["stages_s"] = nvcc_stage_seconds(timing.read_text())
    return result


def row_id(row: dict) -> str:
    """A DICE pair's id, or a leaderboard solution's `L<level>/<problem>/<file prefix>` (as the harness names it)."""
    if "id" in row:
        return str(row["id"])
    return f"L{row['level']}/{int(row['problem_id']) + 1}/{row['file'][:4]}"


def not_built(arguments: dict) -> dict:
    """A mode's record when its build is skipped (--smoke): the size of the CUDA sources it would compile, and its
    nvcc flags."""
    sources = arguments.get("cuda_sources") or []
    chars = len(sources) if isinstance(sources, str) else sum(map(len, sources))
    return {"compiled": False, "nvcc_s": None, "error": "not built (--smoke)", "cuda_chars": chars,
            "extra_cuda_cflags": arguments.get("extra_cuda_cflags") or []}


def run_pair(row: dict, modes: tuple[str, ...], root: Path, stages: bool = False, build: bool = True) -> dict:
    rid = row_id(row)
    arguments = capture_arguments(row.get("cuda_code") or row["code"])
    result = {"id": rid, "modes": {}}
    if not arguments or not arguments.get("cuda_sources"):
        result["error"] = "no load_inline call with cuda_sources"
        return result
    for mode in modes:
        scratch = root / rid.replace("/", "_") / mode
        args = mode_arguments(arguments, mode, scratch)
        if args is None:
            result["modes"][mode] = None
        else:
            result["modes"][mode] = compile_cuda_unit(args, scratch / "build", stages) if build else not_built(args)
        print(f"{rid:>12} {mode:>5}: {result['modes'][mode]}", flush=True)
    return result


def summarize(results: list[dict], modes: tuple[str, ...]) -> dict:
    out = {}
    for mode in modes:
        tried = [r["modes"][mode] for r in results if r.get("modes", {}).get(mode)]
        times = [t["nvcc_s"] for t in tried if t["compiled"]]
        out[mode] = {"tried": len(tried), "compiled": len(times),
                     "median_nvcc_s": statistics.median(times) if times else None}
        per_stage: dict[str, list[float]] = {}
        for t in tried:
            for name, sec in (t.get("stages_s") or {}).items():
                per_stage.setdefault(name, []).append(sec)
        if per_stage:
            out[mode]["median_stage_s"] = {k: statistics.median(v) for k, v in per_stage.items()}
    # the same kernels in every mode, side by side: the ratio that says what a mode saves
    both = [r for r in results if all((r.get("modes", {}).get(m) or {}).get("compiled") for m in modes)]
    for mode in modes[1:]:
        ratios = [r["modes"]["own"]["nvcc_s"] / r["modes"][mode]["nvcc_s"] for r in both]
        out[mode]["median_speedup_vs_own"] = statistics.median(ratios) if ratios else None
    out["compared"] = len(both)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS,
                    help="a JSON list of DICE pairs (cuda_code) or of leaderboard solutions (code)")
    ap.add_argument("--n", type=int, default=12, help="pairs to build, in file order")
    ap.add_argument("--skip", type=int, default=0, help="pairs to skip first")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    ap.add_argument("--jobs", type=int, default=2, help="pairs built at once (each builds its modes in turn)")
    ap.add_argument("--arch", default="9.0", help="TORCH_CUDA_ARCH_LIST (9.0: the H200)")
    ap.add_argument("--stages", action="store_true", help="also nvcc's seconds per step (nvcc --time)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="the package's CUDA examples, no builds (see above)")
    args = ap.parse_args()
    modes = tuple(args.modes.split(","))
    if not set(modes) <= set(MODES) or modes[0] != "own" and len(modes) > 1:
        ap.error(f"--modes: a comma list of {MODES}, starting with own when there are several")
    import torch.utils.cpp_extension as cpp

    if cpp.CUDA_HOME is None and shutil.which("nvcc"):  # a CPU torch: nvcc still compiles the unit
        cpp.CUDA_HOME = str(Path(shutil.which("nvcc")).resolve().parents[1])
    os.environ.update(TORCH_CUDA_ARCH_LIST=args.arch, MAX_JOBS="1")
    if args.smoke:
        rows = [{"id": name.removesuffix(".py"), "code": (EXAMPLES / name).read_text()} for name in SMOKE_SOLUTIONS]
    else:
        rows = json.loads(args.pairs.read_text())[args.skip:args.skip + args.n]
    with tempfile.TemporaryDirectory(prefix="dice-build-headers-") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda r: run_pair(r, modes, Path(tmp), args.stages, not args.smoke), rows))
    summary = summarize(results, modes)
    print(f"{'mode':>6} {'tried':>6} {'compiled':>9} {'median nvcc s':>14} {'x vs own':>9}")
    for mode in modes:
        s = summary[mode]
        med = f"{s['median_nvcc_s']:.1f}" if s["median_nvcc_s"] else "-"
        ratio = s.get("median_speedup_vs_own")
        print(f"{mode:>6} {s['tried']:>6} {s['compiled']:>9} {med:>14} {f'{ratio:.2f}' if ratio else '-':>9}")
    print(f"kernels compiled in every mode: {summary['compared']}")
    for mode in modes:
        if stages := summary[mode].get("median_stage_s"):
            print(f"{mode}: median s per nvcc step: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in sorted(stages.items(), key=lambda kv: -kv[1])))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "results": results}, indent=1))


if __name__ == "__main__":
    main()

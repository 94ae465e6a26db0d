"""What a demo-world CUDA unit that does not compile costs the harness, with and without the second bare attempt
(harness/compiling/bare_cuda.py). Each unit is written as `load_inline` writes it (`#include <torch/types.h>` on
top) and compiled by nvcc with torch's CUDA flags, once per torch/types.h:

    bare       an empty header (the first bare attempt: light_headers.bare_cuda_arguments)
    bare-wide  the headers torch/types.h brings from outside torch (the second, whose failure is final)
    own        torch's own header (what a failed bare attempt fell back to before)

Units: the demo world's fused CUDA solutions for a few programs, and the same with one statement broken (a name
nothing declares: what a rollout that does not compile looks like). Prints, per mode, how many units compiled and
the median seconds; a broken unit costs bare + bare-wide now, bare + own before. Needs nvcc, not a GPU:

    python benchmarks/bare_cuda_build.py --n 3 --out bare_cuda.json
    python benchmarks/bare_cuda_build.py --smoke     # one unit, without `own` (~25 s of nvcc a unit)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.utils.cpp_extension as cpp

from dice_kernels.demo.world import OPS, REDUCTIONS, Spec, cuda_source
from dice_kernels.harness.compiling import bare_cuda


def units(n: int) -> list[tuple[str, str]]:
    """(name, CUDA source): the fused solutions of n programs of one to three ops (every other one closed by a
    reduction), each also with a statement broken."""
    names = [op.name for op in OPS]
    consts = {op.name: op.consts[0] if op.consts else None for op in OPS}
    out = []
    for k in range(n):
        chain = tuple(names[(k + j) % len(names)] for j in range(1 + k % 3))
        reduction = REDUCTIONS[k % len(REDUCTIONS)].name if k % 2 else ""
        source = cuda_source(Spec(chain, reduction, tuple(consts[c] for c in chain), (0,) * (len(chain) + 1), "x",
                                  4, 8))
        out += [(f"fused_{k}", source), (f"broken_{k}", source.replace("float v = px[i];", "float v = pz[i];", 1))]
    return out


def compile_once(nvcc: str, source: str, include_dirs: list[str], tmp: Path) -> tuple[bool, float]:
    unit = tmp / "unit.cu"
    unit.write_text("#include <torch/types.h>\n#include <cuda.h>\n#include <cuda_runtime.h>\n" + source)
    start = time.monotonic()
    done = subprocess.run([nvcc, *bare_cuda.nvcc_flags(), *(f"-I{d}" for d in include_dirs), "-c", str(unit),
                           "-o", str(tmp / "unit.o")], capture_output=True, text=True, timeout=600)
    return done.returncode == 0, round(time.monotonic() - start, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=3, help="programs (each a fused unit and a broken one)")
    ap.add_argument("--nvcc", default=bare_cuda.torch_nvcc() or shutil.which("nvcc") or "nvcc")
    ap.add_argument("--out", type=Path, help="the records as JSON")
    ap.add_argument("--smoke", action="store_true", help="one program, bare and bare-wide only")
    args = ap.parse_args()
    if shutil.which(args.nvcc) is None and not Path(args.nvcc).is_file():
        sys.exit(f"nvcc not found ({args.nvcc}): this benchmark compiles CUDA units (no GPU needed)")
    start = time.monotonic()
    around = bare_cuda.measure(args.nvcc)
    if around is None:
        sys.exit(f"{args.nvcc} could not preprocess torch/types.h")
    measured_s = round(time.monotonic() - start, 1)
    records = []
    with tempfile.TemporaryDirectory(prefix="bare-cuda-bench-") as tmp:
        headers = {}
        for mode, text in (("bare", "// empty\n"), ("bare-wide", around.stub())):
            (Path(tmp) / mode / "torch").mkdir(parents=True)
            (Path(tmp) / mode / "torch" / "types.h").write_text(text)
            headers[mode] = [str(Path(tmp) / mode)]
        if not args.smoke:
            headers["own"] = cpp.include_paths()
        for name, source in units(1 if args.smoke else args.n):
            for mode, include_dirs in headers.items():
                ok, seconds = compile_once(args.nvcc, source, include_dirs, Path(tmp))
                records.append({"unit": name, "mode": mode, "compiled": ok, "s": seconds})
                print(f"{name:10s} {mode:10s} {'compiled' if ok else 'failed':9s} {seconds:6.2f} s", flush=True)
    print(f"\nsurroundings: {len(around.headers)} headers, {len(around.macros)} macros, measured in {measured_s} s")
    print("| mode | units | compiled | median s (fused) | median s (broken) |\n|---|---|---|---|---|")
    for mode in headers:
        mine = [r for r in records if r["mode"] == mode]
        med = {kind: statistics.median([r["s"] for r in mine if r["unit"].startswith(kind)]) for kind in ("fused", "broken")}
        print(f"| {mode} | {len(mine)} | {sum(r['compiled'] for r in mine)} | {med['fused']:.2f} | {med['broken']:.2f} |")
    if args.out:
        args.out.write_text(json.dumps({"nvcc": args.nvcc, "surroundings_s": measured_s,
                                        "headers": list(around.headers), "records": records}, indent=1))


if __name__ == "__main__":
    main()

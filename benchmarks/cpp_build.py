"""What a C++-only `load_inline` build costs with the harness's bare C++ build (harness/compiling/bare_cpp.py) against
torch's own, on the demo world's C++ solutions (fused and op by op, random programs of the world), one build at a
time, and whether every build computes the reference's outputs:

    own      torch's `load_inline` as the candidate wrote it (torch/extension.h parsed: KernelBench's build)
    own+pch  the same with the harness's precompiled torch/extension.h (compiling/speed.py; built first, untimed)
    bare     the bare C++ build: no torch header, C API bindings, its stub header parsed by each build
    bare+pch the same with the stub precompiled (compiling/speed.py, as the harness publishes it; built first, untimed)

    python benchmarks/cpp_build.py --n 6 --out cpp_build.json
    python benchmarks/cpp_build.py --smoke      # 2 solutions, the bare builds only

--smoke skips the modes that parse torch's header (each is 13-20 s of a core); its table still checks every bare
build's outputs against the reference.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
import torch.utils.cpp_extension as cpp  # noqa: E402

from dice_kernels.demo.world import Spec, cpu_source, random_spec, reference_program, slow_cpu_source  # noqa: E402
from dice_kernels.harness.compiling.bare_cpp import build_bare_cpp  # noqa: E402

MODES = ("own", "own+pch", "bare", "bare+pch")
CFLAGS = ["-O3"]  # what the world's programs pass


def solutions(n: int, seed: int) -> list[tuple[str, Spec, str]]:
    """(name, spec, C++ source) of n world solutions, fused and op by op in turn."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        spec = random_spec(rng)
        variant, source = ("fused", cpu_source(spec)) if i % 2 == 0 else ("op_by_op", slow_cpu_source(spec))
        out.append((f"{variant}_{i}", spec, source))
    return out


def reference_outputs(spec: Spec) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The task's inputs and the reference Model's output on them."""
    namespace: dict = {}
    exec(compile(reference_program(spec), "reference", "exec"), namespace)
    torch.manual_seed(0)
    inputs = namespace["get_inputs"]()
    return inputs, namespace["Model"](*namespace["get_init_inputs"]())(*inputs)


def matches(module, spec: Spec) -> bool:
    """Whether the module's `fused` (addresses and sizes, as ModelNew calls it) computes the reference's output."""
    inputs, expected = reference_outputs(spec)
    x = inputs[0]
    out = x.new_empty(x.shape[0]) if spec.reduction else x.new_empty(x.shape)
    module.fused(*(t.data_ptr() for t in inputs), out.data_ptr(), x.shape[0], x.shape[1])
    return torch.allclose(out, expected, rtol=1e-5, atol=1e-5)


def precompiled_headers(cache: Path, modes: list[str]) -> dict[str, str]:
    """{header kind: include dir} of the harness's precompiled torch/extension.h ("own") and bare stub ("bare") for
    CFLAGS, those the modes use (built here if absent)."""
    from dice_kernels.harness.compiling.speed import build_pch, normalize_cflags, plan_pch, planned_pch

    flags = tuple(normalize_cflags(CFLAGS))
    kinds = [kind for kind in ("own", "bare") if f"{kind}+pch" in modes]
    plans = [p for p in plan_pch(cache, with_cuda=False, variants=(flags,), bare=True) if p.kind in kinds]
    build_pch(plans)
    return {kind: planned_pch(plans, kind)[json.dumps(list(flags))] for kind in kinds}


def build(mode: str, name: str, source: str, directory: Path, headers: dict[str, str]):
    arguments = {"name": name, "cpp_sources": source, "functions": ["fused"], "build_directory": str(directory)}
    directory.mkdir(parents=True)
    if mode.startswith("bare"):
        return build_bare_cpp(**arguments, extra_cflags=CFLAGS, stub_dir=headers.get("bare") if mode == "bare+pch"
                              else None)
    return cpp.load_inline(**arguments, extra_cflags=CFLAGS + ([f"-I{headers['own']}"] if mode == "own+pch" else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=6, help="world solutions to build (fused and op by op in turn)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--out", type=Path, help="write the per-build records and the table's figures as JSON")
    parser.add_argument("--smoke", action="store_true", help="2 solutions, the bare builds only")
    args = parser.parse_args()
    modes = ["bare", "bare+pch"] if args.smoke else [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown mode(s) {sorted(unknown)}: choose from {', '.join(MODES)}")
    n = 2 if args.smoke else args.n

    records = []
    with tempfile.TemporaryDirectory(prefix="dice-cpp-build-") as tmp:
        headers = precompiled_headers(Path(tmp) / "cache", modes)
        for name, spec, source in solutions(n, args.seed):
            for mode in modes:
                start = time.perf_counter()
                module = build(mode, f"{name}_{mode.replace('+', '_')}", source, Path(tmp) / name / mode, headers)
                seconds = time.perf_counter() - start
                records.append({"solution": name, "mode": mode, "seconds": round(seconds, 2),
                                "matches_reference": matches(module, spec)})
                print(f"{name:>12} {mode:>8}: {seconds:6.2f} s, outputs "
                      f"{'match' if records[-1]['matches_reference'] else 'DIFFER from'} the reference", flush=True)

    summary = {}
    print(f"\n{n} demo-world C++ solutions (fused and op by op in turn), one build at a time, torch "
          f"{torch.__version__}\n")
    print("| build | median s | min / max s | outputs match the reference |\n|---|---|---|---|")
    for mode in modes:
        rows = [r for r in records if r["mode"] == mode]
        times = [r["seconds"] for r in rows]
        summary[mode] = {"median_s": statistics.median(times), "matches": sum(r["matches_reference"] for r in rows),
                         "builds": len(rows)}
        print(f"| {mode} | {statistics.median(times):.2f} | {min(times):.2f} / {max(times):.2f} | "
              f"{summary[mode]['matches']} of {len(rows)} |")
    fastest = "bare+pch" if "bare+pch" in summary else "bare"
    if fastest in summary:
        for mode in ("own", "own+pch", "bare"):
            if mode in summary and mode != fastest:
                print(f"\n{mode} / {fastest} (medians): "
                      f"{summary[mode]['median_s'] / summary[fastest]['median_s']:.1f}x")
    if args.out:
        args.out.write_text(json.dumps({"records": records, "summary": summary, "torch": torch.__version__}, indent=1))
    if any(not r["matches_reference"] for r in records):
        sys.exit("a build's outputs differ from the reference")


if __name__ == "__main__":
    main()

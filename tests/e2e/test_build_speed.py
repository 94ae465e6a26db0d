"""build_speed: the light and lean CUDA headers, flag normalisation, and a real build through the precompiled header."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from dice_kernels.harness import BuildConfig, EvalConfig, Outcome, TimingConfig, evaluate
from dice_kernels.harness.compiling.speed import (SPARE_TIME_NICE, PchPlan, announce_pch, build_pch, may_build_bare,
                                                  normalize_cflags, pch_file, pch_lock, pch_variants,
                                                  pch_wait_environment, plan_pch, planned_pch, read_pch_wait,
                                                  reporting_nvcc)
from dice_kernels.harness.compiling.light_headers import (bare_cuda_arguments, declarations_only, lean_aten_headers,
                                                          light_cuda_sources, light_extension_header)

KERNEL = "#include <torch/extension.h>\n#include <cuda_runtime.h>\n__global__ void k() {}\n"


def test_light_sources_drop_only_the_extension_include():
    (light,) = light_cuda_sources(KERNEL)
    assert "#include <torch/extension.h>" not in light
    assert "#include <cuda_runtime.h>" in light and "__global__ void k() {}" in light
    assert light_cuda_sources([KERNEL, "int x;"])[1] == "int x;"


def test_light_sources_leave_code_that_needs_the_full_header():
    assert light_cuda_sources(None) is None
    assert light_cuda_sources("#include <torch/types.h>\n__global__ void k() {}") is None  # nothing to drop
    assert light_cuda_sources(KERNEL + "PYBIND11_MODULE(m, m) {}") is None
    assert light_cuda_sources(KERNEL + "auto y = torch::nn::functional::relu(x);") is None


BARE_KERNEL = "#include <cstdint>\n__global__ void k(float* p) { p[0] = 1.0f; }  // at: no torch\n"


def test_bare_attempt_is_for_cuda_sources_that_name_nothing_of_torch(tmp_path):
    arguments = {"name": "e", "cpp_sources": "void f(int64_t p);", "cuda_sources": [BARE_KERNEL],
                 "extra_cuda_cflags": ["-O3"]}
    bare = bare_cuda_arguments(arguments, tmp_path / "inc")
    # only the flags change: an empty header is found first for load_inline's implicit torch/types.h
    assert bare == {**arguments, "extra_cuda_cflags": ["-O3", f"-I{tmp_path / 'inc'}"]}
    assert "#include" not in (tmp_path / "inc" / "torch" / "types.h").read_text()
    for named in ("torch::Tensor f();", "at::Tensor f();", "c10::Half h;", "Tensor t;", "#include <torch/extension.h>"):
        assert bare_cuda_arguments({**arguments, "cuda_sources": BARE_KERNEL + named}, tmp_path / "x") is None, named
    assert bare_cuda_arguments({"name": "e", "cpp_sources": "int f();"}, tmp_path / "y") is None
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_demo_worlds_cuda_units_compile_without_any_torch_header(tmp_path):
    """The demo world's CUDA solutions (fused and op by op) name nothing of torch: nvcc compiles each unit, as
    load_inline writes it, with the bare attempt's empty header and no torch include directory."""
    from dice_kernels.demo.world import MAX_CHAIN, OPS, REDUCTIONS, Spec, cuda_source, slow_cuda_source

    ops = [op.name for op in OPS]
    chains = [ops[i:i + MAX_CHAIN] for i in range(0, len(ops), MAX_CHAIN)]
    specs = [Spec(tuple(c), r.name, tuple(op.consts[0] if op.consts else None for op in OPS if op.name in c),
                  (0,) * (len(c) + 1), "x", 4, 8) for c, r in zip(chains, [*REDUCTIONS, *REDUCTIONS])]
    specs.append(Spec((), "sum", (), (0,), "x", 4, 8))
    for k, spec in enumerate(specs):
        for source in (cuda_source(spec), slow_cuda_source(spec)):
            arguments = bare_cuda_arguments({"name": "e", "cpp_sources": "", "cuda_sources": source}, tmp_path / "inc")
            assert arguments is not None, source
            unit = tmp_path / f"u{k}.cu"
            unit.write_text("#include <torch/types.h>\n#include <cuda.h>\n#include <cuda_runtime.h>\n" + source)
            out = subprocess.run(["nvcc", *arguments["extra_cuda_cflags"], "-c", str(unit), "-o", str(unit) + ".o"],
                                 capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-2000:]


def test_cflags_normalise_like_torch():
    assert normalize_cflags(None) == ()
    assert normalize_cflags([""]) == ()  # the leaderboard's common extra_cflags=[""]
    assert normalize_cflags(["-O3 ", ""]) == ("-O3",)
    assert normalize_cflags("-O3") == ("-O3",)


def test_headers_are_planned_for_the_flags_a_batch_names():
    o3 = 'load_inline(name="x", cpp_sources=s, extra_cflags=["-O3"])'
    assert pch_variants(["load_inline(name='x', cpp_sources=s)", o3]) == ((), ("-O3",))
    assert pch_variants(['load_inline(name="x", cuda_sources=s, extra_cuda_cflags=["-O3"])']) == ((),)
    assert pch_variants(['flags = ["-O3"]\nload_inline(name="x", cpp_sources=s, extra_cflags=flags)']) == (
        (), ("-O3",))  # flags named elsewhere in the code count too
    assert pch_variants([]) == ((),)


@pytest.fixture(scope="module")
def cold_batch(tmp_path_factory, example_pairs):
    """(cache, result, pch) of a cold cache's first batch: one candidate that does not compile, whose build waits
    for the header being built and then has it; `pch` lists what the batch left in the cache's pch folder (the
    next test adds to it). The header it publishes serves the next run (one header build for both tests)."""
    cache = tmp_path_factory.mktemp("pch-cache")
    pairs = [p for p in example_pairs("cpu") if p[1].id == "19_ReLU/broken"]
    config = EvalConfig(backend="cpu", trials=1, cache_dir=cache, timing=TimingConfig(enabled=False))
    (result,) = evaluate(pairs, config, progress=False)
    return cache, result, list((cache / "pch").rglob("*"))


def test_cpu_build_uses_the_precompiled_header_and_keeps_the_outcome(tmp_path, example_pairs, cold_batch):
    pairs = [p for p in example_pairs("cpu") if p[1].id in ("19_ReLU/correct", "19_ReLU/broken")]
    # evaluate() prepares the header in the background (early builds do without it); a cache whose header is
    # published already (the cold batch's; nothing left to build) so these builds take it. The correct one
    # without its -O3: that flag's header would be built first (~40 s here)
    pairs = [(task, replace(cand, code=re.sub(r',\s*extra_cflags=\["-O3"\]', "", cand.code))) for task, cand in pairs]
    assert all("-O3" not in cand.code for _, cand in pairs)
    cache, _, _ = cold_batch
    (plan,) = plan_pch(cache, with_cuda=False, variants=((),))  # the flags these candidates name: none
    assert plan.ready
    fast = EvalConfig(backend="cpu", trials=2, cache_dir=cache, timing=TimingConfig(enabled=False))
    plain = EvalConfig(backend="cpu", trials=2, cache_dir=tmp_path / "plain", timing=TimingConfig(enabled=False),
                       build=BuildConfig(fast=False))
    with_pch = {r.candidate_id: r for r in evaluate(pairs, fast, progress=False)}
    # without the shortcuts, the one that does not compile (a build through torch's whole header costs ~25 s here)
    (without,) = evaluate([p for p in pairs if p[1].id == "19_ReLU/broken"], plain, progress=False)
    assert {k: r.outcome for k, r in with_pch.items()} == {
        "19_ReLU/correct": Outcome.CORRECT, "19_ReLU/broken": Outcome.COMPILE_ERROR}
    assert without.outcome is Outcome.COMPILE_ERROR  # and the same diagnostics (the build directories differ)
    assert re.findall(r"error: .*", without.error) == re.findall(r"error: .*", with_pch["19_ReLU/broken"].error) != []
    assert [s["pch"] for s in with_pch["19_ReLU/correct"].build.shortcuts] == [True]
    assert [s["pch"] for s in without.build.shortcuts] == [False]
    assert list((cache / "pch").glob("*/torch/extension.h.gch"))
    assert not (tmp_path / "plain" / "pch").exists()
    # the compiler's own message, not one about the header shortcut
    assert "extension.h" not in with_pch["19_ReLU/broken"].error


def test_a_cold_batch_waits_for_the_header_and_publishes_it_for_the_next_run(cold_batch):
    _, result, pch = cold_batch
    assert result.outcome is Outcome.COMPILE_ERROR
    assert "extension.h" not in result.error  # the compiler's own message about the candidate's code
    (shortcut,) = result.build.shortcuts
    assert shortcut["pch"] is True and shortcut["pch_wait_s"] > 0  # main.cpp waited for the header, then had it
    assert not [p for p in pch if p.name.endswith(".building")]
    (header,) = [p for p in pch if p.match("*/torch/extension.h.gch")]  # for extra_cflags [] only: no code names others
    assert (header.parent / "extension.h").resolve().name == "extension.h"
    assert "-O3" not in json.loads((header.parent.parent / "command.json").read_text())


UMBRELLA = """#pragma once
#include <ATen/Context.h>
#include <ATen/ops/add.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/var.h>
namespace at {
inline Tensor var(const Tensor& self, int dim) { return at::var(self, IntArrayRef{dim}); }
}
"""


def test_lean_umbrella_keeps_the_named_operators_and_those_its_own_code_names():
    from dice_kernels.harness.compiling.light_headers import _OPS_INCLUDE, lean_umbrella

    lean = lean_umbrella(UMBRELLA, _OPS_INCLUDE["Functions.h"], {"relu", "x"})
    assert "#include <ATen/ops/relu.h>" in lean  # named by the sources
    assert "#include <ATen/ops/var.h>" in lean  # its overload `var(self, int)` is defined here: never cut
    assert "#include <ATen/ops/add.h>" not in lean
    assert "#include <ATen/Context.h>" in lean and "inline Tensor var" in lean


def test_lean_headers_cut_torchs_umbrellas_to_the_operators_named(tmp_path):
    import re

    import torch

    aten = Path(torch.__file__).parent / "include" / "ATen"
    flags = lean_aten_headers("auto y = torch::empty_like(x); auto z = at::sigmoid(y);", tmp_path)
    assert flags == ["-DAT_PER_OPERATOR_HEADERS", f"-I{tmp_path}"]
    ops = set(re.findall(r"<ATen/ops/(\w+)\.h>", (tmp_path / "ATen" / "Functions.h").read_text()))
    assert {"empty_like", "sigmoid", "var"} <= ops and "conv2d" not in ops
    assert len(ops) < len(re.findall(r"<ATen/ops/\w+\.h>", (aten / "Functions.h").read_text())) / 10
    native = (tmp_path / "ATen" / "NativeFunctions.h").read_text()
    assert "<ATen/ops/sigmoid_native.h>" in native and "<ATen/ops/conv2d_native.h>" not in native


def _syntax_check(source: str, flags: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """g++ over `source` with torch's include paths: the same headers the CUDA unit parses, in C++."""
    import torch.utils.cpp_extension as cpp

    (tmp_path / "unit.cpp").write_text(source)
    includes = [f"-isystem{p}" for p in cpp.include_paths()]
    return subprocess.run(["g++", "-std=c++17", "-fsyntax-only", *includes, *flags, str(tmp_path / "unit.cpp")],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_lean_headers_compile_what_the_sources_name_and_fail_on_what_they_hide(tmp_path):
    named = ("#include <torch/types.h>\n"
             "at::Tensor f(const at::Tensor& x) { auto y = torch::empty_like(x); return at::var(y, 1) + torch::relu(x); }\n")
    checked = _syntax_check(named, lean_aten_headers(named, tmp_path / "named"), tmp_path)
    assert checked.returncode == 0, checked.stderr[-2000:]
    # an operator named only through token pasting is not seen: the lean unit fails (the build then falls back
    # to the light and the candidate's own headers, where it compiles)
    hidden = "#include <torch/types.h>\n#define OP(a, b) at::a##b\nat::Tensor f(const at::Tensor& x) { return OP(sig, moid)(x); }\n"
    assert _syntax_check(hidden, lean_aten_headers(hidden, tmp_path / "hidden"), tmp_path).returncode != 0
    assert _syntax_check(hidden, [], tmp_path).returncode == 0


def _header_dir(root: Path, ready: bool = True) -> Path:
    (root / "torch").mkdir(parents=True)
    if ready:
        (root / "torch" / "extension.h.gch").write_bytes(b"")
    return root


def _build_job(**kw):
    from dice_kernels.harness.process.protocol import BuildJob

    return BuildJob(workdir="", device="cuda", limits={}, candidate_path="", build_dir="", **kw)


def test_cuda_builds_try_the_lean_headers_then_the_candidates_own(tmp_path):
    from dice_kernels.harness.compiling.in_sandbox import BuildLog, _build_attempts

    full, light = _header_dir(tmp_path / "full"), _header_dir(tmp_path / "light")
    job = _build_job(light_headers=True, pch={"[]": str(full)}, pch_light={"[]": str(light)})
    arguments = {"name": "ext", "cpp_sources": "torch::Tensor f(torch::Tensor x);",
                 "cuda_sources": KERNEL + "// torch::relu", "extra_cuda_cflags": ["-O3"]}
    log = BuildLog()
    attempts = _build_attempts(job, arguments, tmp_path / "ext_1", log, "ext#1")
    assert [(a.headers, a.directory.name, a.env) for a in attempts] == [("lean", "ext_1", None),
                                                                        ("own", "ext_1_own", None)]  # ready
    lean, own = (a.arguments for a in attempts)
    assert lean["extra_cuda_cflags"][:2] == ["-O3", "-DAT_PER_OPERATOR_HEADERS"]
    assert lean["cuda_sources"] == light_cuda_sources(arguments["cuda_sources"])
    assert own["cuda_sources"] == arguments["cuda_sources"] and own["extra_cuda_cflags"] == ["-O3"]
    # main.cpp: the light torch/extension.h for cpp_sources that only declare, torch's own in the last attempt
    assert lean["extra_cflags"] == [f"-I{light}"] and own["extra_cflags"] == [f"-I{full}"]
    assert log.shortcuts == [{"key": "ext#1", "pch": True, "headers": [], "light_main": True}]
    defines = {**arguments, "cpp_sources": "torch::Tensor f(torch::Tensor x) { return x; }"}
    assert [a.arguments["extra_cflags"] for a in _build_attempts(job, defines, tmp_path / "d", log, "d#1")] == [
        [f"-I{full}"], [f"-I{full}"]]
    assert "light_main" not in log.shortcuts[-1]
    # CUDA sources that name nothing of torch: the bare attempt first (main.cpp still takes the light header)
    bare = _build_attempts(job, {**arguments, "cuda_sources": BARE_KERNEL}, tmp_path / "n", log, "n#1")
    assert [(a.headers, a.directory.name) for a in bare] == [("bare", "n"), ("own", "n_own")]
    assert bare[0].arguments["extra_cuda_cflags"] == ["-O3", f"-I{tmp_path / 'n_bare_include'}"]
    assert bare[0].arguments["extra_cflags"] == [f"-I{light}"] and log.shortcuts[-1]["light_main"]
    # code that visibly needs the Python bindings or the C++ frontend, and the CPU backend, build as written
    bindings = {**arguments, "cuda_sources": KERNEL + "PYBIND11_MODULE(m, m) {}"}
    assert [a.headers for a in _build_attempts(job, bindings, tmp_path / "b", log, "b#1")] == ["own"]
    cpu_job = _build_job()
    cpu = _build_attempts(cpu_job, {"name": "e", "cpp_sources": "x"}, tmp_path / "e", log, "e#1")
    assert [(a.headers, a.directory.name) for a in cpu] == [("own", "e")]


def test_each_attempt_waits_for_its_own_header(tmp_path, monkeypatch):
    from dice_kernels.harness.compiling.in_sandbox import BuildLog, _build_attempts

    monkeypatch.setenv("PYTORCH_NVCC", "nvcc")  # the nvcc torch would run, whether or not this machine has one

    # as plan_pch plans them for CUDA: the light header for first attempts, torch's own in spare time
    plans = [PchPlan((), _header_dir(tmp_path / "pch" / name, ready=False), ["false"], tmp_path / "extension.h",
                     text, nice, kind)
             for name, text, nice, kind in (("full", None, SPARE_TIME_NICE, "own"), ("light", "// light\n", 0, "light"))]
    compiler = announce_pch(plans, tmp_path)
    job = _build_job(light_headers=True, pch=planned_pch(plans), pch_light=planned_pch(plans, "light"),
                     pch_compiler=compiler)
    arguments = {"name": "ext", "cpp_sources": "torch::Tensor f(torch::Tensor x);", "cuda_sources": KERNEL}
    lean, own = _build_attempts(job, arguments, tmp_path / "ext_1", BuildLog(), "ext#1")
    assert lean.env["DICE_PCH_FILE"] == str(pch_file(plans[1].root))
    assert own.env["DICE_PCH_FILE"] == str(pch_file(plans[0].root))
    # torch's own header is the spare-time one here: waited for only while the CUDA unit compiles
    assert own.env.get("DICE_PCH_SPARE_TIME") == "1" and "DICE_PCH_SPARE_TIME" not in lean.env
    cpp_only = {"name": "cc", "cpp_sources": "torch::Tensor f(torch::Tensor x) { return x; }"}
    assert [a.env for a in _build_attempts(job, cpp_only, tmp_path / "cc_1", BuildLog(), "cc#1")] == [None]


def _announced(tmp_path: Path, name: str = "key", nice: int = 0) -> tuple[PchPlan, str]:
    plan = PchPlan(variant=(), root=tmp_path / "pch" / name, command=["false"], header=tmp_path / "extension.h",
                   nice=nice)
    compiler = announce_pch([plan], tmp_path)
    assert compiler is not None and plan.building.exists()
    return plan, compiler


def _compile_through(compiler: str, plan: PchPlan, build: Path, nvcc: str | None = None) -> subprocess.Popen:
    build.mkdir()
    (build / "unit.cpp").write_text("int unit() { return 1; }\n")
    env = {**os.environ, **pch_wait_environment(str(plan.root), compiler, nvcc)}
    return subprocess.Popen([compiler, "-c", "unit.cpp", "-o", "unit.o"], cwd=build, env=env)


def _waits(proc: subprocess.Popen, loops: int = 1, timeout_s: float = 60.0) -> bool:
    """True once the waiting compiler `proc` has gone round its wait loop `loops` times from now, seen as that many
    distinct `sleep` children of it: an event to wait for, where a fixed sleep would race a loaded machine."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                pid, rest = stat.read_text().split(" (", 1)
                comm, fields = rest.rsplit(") ", 1)
            except (OSError, ValueError):
                continue
            if comm == "sleep" and int(fields.split()[1]) == proc.pid:
                seen.add(int(pid))
        if len(seen) >= loops:
            return True
        time.sleep(0.02)
    return False


def test_a_compile_waits_until_the_header_being_built_is_published(tmp_path):
    plan, compiler = _announced(tmp_path)
    compile_ = _compile_through(compiler, plan, tmp_path / "build")
    assert _waits(compile_)  # a one-line compile, waiting for the header
    pch_file(plan.root).parent.mkdir(parents=True)
    pch_file(plan.root).write_bytes(b"")  # published (GCC never reads it: unit.cpp includes nothing)
    assert compile_.wait(timeout=60) == 0 and (tmp_path / "build" / "unit.o").exists()
    wait = read_pch_wait(tmp_path / "build")
    assert wait["found"] is True and wait["waited_s"] > 0  # it waited (it was still waiting above), then found it
    assert pch_wait_environment(str(plan.root), compiler) is None  # published: later builds compile as usual


def test_a_failed_header_build_releases_the_waiting_compiles(tmp_path):
    plan, compiler = _announced(tmp_path)
    compile_ = _compile_through(compiler, plan, tmp_path / "build")
    assert _waits(compile_)
    assert not build_pch([plan])  # its command fails: nothing is published and the mark is taken away
    assert not plan.building.exists()
    assert compile_.wait(timeout=60) == 0 and read_pch_wait(tmp_path / "build")["found"] is False
    assert pch_wait_environment(str(plan.root), compiler) is None  # nobody builds it: nothing to wait for


def test_a_spare_time_header_compiles_at_its_niceness(tmp_path):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base >= 19:
        pytest.skip("this process already runs at the lowest priority")
    # the "compiler" records its niceness and writes the header: build_pch runs it as `command header -o out`
    record = ["sh", "-c", 'cut -d" " -f19 /proc/self/stat > "$0.nice"; : > "$2"']
    plans = [PchPlan((), tmp_path / "pch" / name, record, tmp_path / name, nice=nice)
             for name, nice in (("first", 0), ("spare", SPARE_TIME_NICE))]
    assert len(build_pch(plans)) == 1  # both published; planned_pch names one per variant
    assert all(p.ready for p in plans)
    assert int((tmp_path / "first.nice").read_text()) == base
    assert int((tmp_path / "spare.nice").read_text()) == min(19, base + SPARE_TIME_NICE)


def test_a_header_another_process_holds_is_built_once(tmp_path):
    """Processes on one cache (the suite's two workers) plan the same headers: the one holding a header's lock
    builds it, and the other waits for the lock instead of compiling it too. Here "another process" holds both
    locks: it publishes one (not built again here) and its build of the other fails (built here after it)."""
    import fcntl
    import threading

    record = ["sh", "-c", 'echo run >> "$0.runs"; : > "$2"']  # as build_pch runs it: `command header -o out`
    published, failed = plans = [PchPlan(variant, tmp_path / "pch" / name, record, tmp_path / name)
                                 for name, variant in (("published", ()), ("failed", ("-O3",)))]
    announce_pch(plans, tmp_path)
    held = [open(pch_lock(p.root), "a") for p in plans]
    for lock in held:
        fcntl.flock(lock, fcntl.LOCK_EX)
    built = {}
    thread = threading.Thread(target=lambda: built.update(build_pch(plans)))
    thread.start()
    pch_file(published.root).parent.mkdir(parents=True)
    pch_file(published.root).write_bytes(b"")  # the other process publishes it, takes its mark away, unlocks
    published.building.unlink()
    held[0].close()
    failed.building.unlink()  # its build of the other failed: mark taken away, unlocked
    held[1].close()
    thread.join(timeout=60)
    assert not thread.is_alive() and built == {"[]": str(published.root), '["-O3"]': str(failed.root)}
    assert not (tmp_path / "published.runs").exists()  # the other's header, not compiled again
    assert (tmp_path / "failed.runs").read_text() == "run\n"  # compiled here once the other's build had failed
    assert not published.building.exists() and not failed.building.exists()


def test_a_spare_time_header_another_process_builds_is_left_to_it_when_the_batch_is_over(tmp_path):
    import fcntl
    import threading

    spare = PchPlan((), tmp_path / "pch" / "spare", ["false"], tmp_path / "spare", nice=SPARE_TIME_NICE)
    announce_pch([spare], tmp_path)
    over = threading.Event()
    over.set()
    with open(pch_lock(spare.root), "a") as held:  # another process is building it
        fcntl.flock(held, fcntl.LOCK_EX)
        assert build_pch([spare], abandon=over) == {}
        assert spare.building.exists()  # its mark stays: the other process's builds still wait for its header


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                return True  # killed, not reaped yet
        except (OSError, IndexError):
            return True
        time.sleep(0.1)
    return False


def test_a_spare_time_header_is_abandoned_with_its_compiler_when_the_batch_is_over(tmp_path):
    import threading

    # a "compiler" that starts a child of its own (as the driver starts cc1plus) and takes long
    slow = ["sh", "-c", 'sleep 60 & echo $! > "$0.pid"; wait; : > "$2"']
    quick = ["sh", "-c", 'sleep 1; : > "$2"']
    spare = PchPlan((), tmp_path / "pch" / "spare", slow, tmp_path / "spare", nice=SPARE_TIME_NICE)
    own = PchPlan(("-O3",), tmp_path / "pch" / "own", quick, tmp_path / "own")
    announce_pch([spare, own], tmp_path)
    over, built = threading.Event(), {}
    thread = threading.Thread(target=lambda: built.update(build_pch([spare, own], abandon=over)))
    thread.start()
    while not (tmp_path / "spare.pid").exists() and thread.is_alive():
        time.sleep(0.05)
    over.set()  # the batch is over while both are being built: only the spare-time one is left
    thread.join(timeout=30)
    assert not thread.is_alive() and built == {'["-O3"]': str(own.root)}
    assert own.ready and not spare.ready and not spare.building.exists()
    assert _gone(int((tmp_path / "spare.pid").read_text()))  # the compiler's own child was killed too
    assert not list((tmp_path / "pch").glob(".spare-*"))  # nothing half-written is left


def test_with_the_light_header_torchs_own_is_planned_for_spare_time(tmp_path):
    plans = plan_pch(tmp_path / "cache", with_cuda=False, variants=((),), light=True)
    assert sorted((p.text is None, p.nice) for p in plans) == [(False, 0), (True, SPARE_TIME_NICE)]
    assert [p.nice for p in plan_pch(tmp_path / "cache", with_cuda=False, variants=((),))] == [0]


def test_the_bare_stub_is_planned_beside_torchs_own_without_demoting_it(tmp_path):
    """The stub serves only sources that name nothing of torch; the rest still wait for torch's own header."""
    plans = plan_pch(tmp_path / "cache", with_cuda=False, variants=((),), bare=True)
    assert sorted((p.kind, p.nice) for p in plans) == [("bare", 0), ("own", 0)]
    assert planned_pch(plans, "bare") == {"[]": str(plans[1].root)} and plans[1].text.startswith("// dice-kernels")
    launcher = 'load_inline(name="e", cpp_sources="void f(int64_t x) {}", functions=["f"])'
    assert may_build_bare(launcher) and not may_build_bare(launcher.replace("int64_t x", "torch::Tensor x"))
    assert not may_build_bare("import torch")  # nothing to build


def test_the_waiting_compiler_passes_other_calls_straight_through(tmp_path):
    plan, compiler = _announced(tmp_path)
    env = {**os.environ, **pch_wait_environment(str(plan.root), compiler)}
    version = subprocess.run([compiler, "-dumpfullversion"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=30)  # torch's compiler check, while the header is still missing
    real = subprocess.run(["c++", "-dumpfullversion"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and version.stdout == real.stdout
    assert read_pch_wait(tmp_path) is None


def test_no_waiting_compiler_where_torch_could_not_run_it(tmp_path):
    spaced = tmp_path / "a cache"
    plan = PchPlan(variant=(), root=spaced / "pch" / "key", command=["false"], header=tmp_path / "extension.h")
    compiler = announce_pch([plan], spaced)
    assert plan.building.exists()
    assert pch_wait_environment(str(plan.root), compiler) is None  # its path has a space: compile without waiting


def test_a_failed_cuda_unit_ends_the_wait_and_skips_the_compile(tmp_path):
    # the "CUDA unit" is a C++ file with an error, compiled by the real c++ standing in for nvcc: what matters is
    # that a failing compiler behind the reporting nvcc releases the waiting compile of the same build
    plan, compiler = _announced(tmp_path)
    build = tmp_path / "build"
    waiting = _compile_through(compiler, plan, build, nvcc="c++")
    (build / "cuda.cu").write_text("int unit2() { return tile_k; }\n")
    env = {**os.environ, **pch_wait_environment(str(plan.root), compiler, "c++")}
    assert _waits(waiting)  # waiting for the header
    cuda = subprocess.run([env["PYTORCH_NVCC"], "-x", "c++", "-c", "cuda.cu", "-o", "cuda.o"], cwd=build, env=env,
                          capture_output=True, text=True, timeout=60)
    assert cuda.returncode != 0 and "tile_k" in cuda.stderr  # the real compiler's status and message
    assert waiting.wait(timeout=30) != 0  # the header is still being built, but the build has failed
    assert not (build / "unit.o").exists()
    wait = read_pch_wait(build)
    assert wait["skipped"] is True and wait["found"] is False and wait["waited_s"] < 30
    assert plan.building.exists()


def test_a_spare_time_header_is_waited_for_only_while_the_cuda_unit_compiles(tmp_path):
    spare_plan, compiler = _announced(tmp_path, "spare", nice=SPARE_TIME_NICE)
    kept_plan, _ = _announced(tmp_path, "kept")
    spare, kept = tmp_path / "spare", tmp_path / "kept"
    waiting = {}
    for build, plan in ((spare, spare_plan), (kept, kept_plan)):
        build.mkdir()
        (build / "unit.cpp").write_text("int unit() { return 1; }\n")
        (build / "cuda.cu").write_text("int unit2() { return 2; }\n")
        env = {**os.environ, **pch_wait_environment(str(plan.root), compiler, "c++")}
        waiting[build] = subprocess.Popen([compiler, "-c", "unit.cpp", "-o", "unit.o"], cwd=build, env=env)
        cuda = subprocess.run([env["PYTORCH_NVCC"], "-x", "c++", "-c", "cuda.cu", "-o", "cuda.o"], cwd=build,
                              env=env, timeout=60)
        assert cuda.returncode == 0
    assert waiting[spare].wait(timeout=30) == 0 and (spare / "unit.o").exists()  # compiled without the header
    wait = read_pch_wait(spare)
    assert not wait["found"] and not wait["skipped"]
    # a header built at full priority is still worth waiting for: a second turn of the loop after its CUDA unit
    # compiled shows it did not stop there
    assert _waits(waiting[kept], loops=2)
    # no CUDA unit to end the wait: a spare-time header is not waited for at all
    assert pch_wait_environment(str(spare_plan.root), compiler, None) is None
    assert pch_wait_environment(str(kept_plan.root), compiler, None) is not None
    pch_file(kept_plan.root).parent.mkdir(parents=True)
    pch_file(kept_plan.root).write_bytes(b"")
    assert waiting[kept].wait(timeout=60) == 0 and read_pch_wait(kept)["found"] is True


def test_the_reporting_nvcc_marks_how_the_cuda_unit_ended(tmp_path):
    plan, compiler = _announced(tmp_path)
    env = {**os.environ, **pch_wait_environment(str(plan.root), compiler, "c++")}
    assert env["PYTORCH_NVCC"] == str(reporting_nvcc(compiler))
    (tmp_path / "ok.cpp").write_text("int ok() { return 0; }\n")
    ok = subprocess.run([env["PYTORCH_NVCC"], "-c", "ok.cpp", "-o", "ok.o"], cwd=tmp_path, env=env, timeout=60)
    assert ok.returncode == 0 and (tmp_path / "ok.o").exists()
    assert (tmp_path / "cuda_unit_built").exists() and not (tmp_path / "cuda_unit_failed").exists()
    assert "PYTORCH_NVCC" not in pch_wait_environment(str(plan.root), compiler)  # no nvcc known: torch's own


def test_the_light_header_is_torchs_without_the_frontend():
    import torch

    own = (Path(torch.__file__).parent / "include" / "torch" / "extension.h").read_text()
    light = light_extension_header(own)
    assert "#include <torch/all.h>" in own and "#include <torch/all.h>" not in light
    assert "#include <torch/python.h>" in light  # the bindings and every pybind11 type caster
    assert light_extension_header(light) is None  # nothing to drop


def test_only_function_declarations_take_the_light_header():
    dice = ("#include <torch/extension.h>\n// the kernels\n"
            "torch::Tensor upsample(torch::Tensor input, const std::vector<double>& scale_factor);\n"
            "std::vector<at::Tensor> norm(const at::Tensor& x, double eps = 1e-5, int64_t dim=-1);\n")
    assert declarations_only(dice) and declarations_only([dice, "at::Tensor* f(int n);"])
    for code in ("torch::Tensor f(torch::Tensor x) { return x; }",  # a body calls things
                 "torch::Tensor f(torch::Tensor x = torch::ones({1}));",  # so does a default argument
                 "using namespace torch;", "int x;", 'extern "C" void f();',
                 "#define D(n) torch::Tensor n(torch::Tensor);\nD(f);",
                 "torch::Tensor f(torch::Tensor x, void (*cb)(int));"):
        assert not declarations_only(code), code


def test_bindings_built_against_the_light_precompiled_header_work(tmp_path):
    import torch
    from torch.utils.cpp_extension import load

    plans = plan_pch(tmp_path / "cache", with_cuda=False, variants=((),), light=True)
    (light,) = [p for p in plans if p.text is not None]
    assert len(plans) == 2 and build_pch([light]) == {} and light.ready  # its own header, beside torch's
    # main.cpp as load_inline writes it, for cpp_sources that declare what the other unit defines
    main = tmp_path / "main.cpp"
    main.write_text('#include <torch/extension.h>\n'
                    'torch::Tensor twice(torch::Tensor x, const std::vector<double>& scale);\n'
                    'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n'
                    'm.def("twice", torch::wrap_pybind_function(twice), "twice");\n}\n')
    used = subprocess.run([*light.unit_command(), "-DTORCH_EXTENSION_NAME=probe", "-Winvalid-pch", "-H",
                           "-fsyntax-only", str(main)], capture_output=True, text=True, timeout=600)
    assert used.returncode == 0, used.stderr[-2000:]
    assert f"! {pch_file(light.root)}" in used.stderr  # GCC took the light precompiled header
    impl = tmp_path / "impl.cpp"
    impl.write_text("#include <torch/types.h>\n#include <vector>\n"
                    "torch::Tensor twice(torch::Tensor x, const std::vector<double>& scale) "
                    "{ return x * 2 * scale.at(0); }\n")
    module = load("dice_light_probe", [str(main), str(impl)], extra_cflags=[f"-I{light.root}"],
                  build_directory=str(tmp_path), verbose=False)
    assert torch.equal(module.twice(torch.ones(3), [1.5]), torch.full((3,), 3.0))  # the vector caster is there
    # a declaration that names the C++ frontend does not compile with it: the build falls back to torch's own
    main.write_text("#include <torch/extension.h>\nvoid step(torch::optim::SGD& optimizer);\n")
    light_compile = subprocess.run([*light.unit_command(), "-fsyntax-only", str(main)],
                                   capture_output=True, text=True, timeout=600)
    assert light_compile.returncode != 0 and "optim" in light_compile.stderr


def test_a_unit_compiles_with_the_headers_flags_and_finds_it_first(tmp_path):
    plan = PchPlan((), tmp_path / "h", ["g++", "-x", "c++-header", "-O2", "-fPIC", "-std=c++17"], tmp_path / "e.h")
    assert plan.unit_command() == ["g++", "-O2", "-fPIC", "-std=c++17", f"-I{tmp_path / 'h'}"]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_build_jobs_follow_the_cpus_the_process_may_use_not_the_hosts():
    """os.cpu_count() counts the host's CPUs, whatever share of them a cpuset or taskset gives the process; the
    default build jobs and CPU count come from the process's affinity mask."""
    import sys

    code = ("import os; from dice_kernels.harness.config import BuildConfig, usable_cpus; "
            "print(os.cpu_count(), usable_cpus(), BuildConfig().jobs)")
    pinned = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
    host, usable, jobs = map(int, pinned.stdout.split())
    assert (usable, jobs) == (1, 1) and host >= 1
    free = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert 1 <= int(free.stdout.split()[1]) <= len(os.sched_getaffinity(0))  # a cgroup CPU quota may cap it

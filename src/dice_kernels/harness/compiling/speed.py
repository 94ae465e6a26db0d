"""Compile-time savings that never change what a candidate's code means.

A `load_inline` build compiles two translation units, each parsing PyTorch's heavy headers:
- `main.cpp` starts with `#include <torch/extension.h>`: the trusted parent precompiles that header once per
  (compiler flags, torch) into the build cache (`plan_pch`/`build_pch`, in the background; on a cache shared by
  processes, by the one holding its `pch_lock`). Builds that start
  before it is ready compile their CUDA unit meanwhile while `main.cpp` waits for the header
  (`announce_pch`, `pch_wait_environment`): parsing the header without it costs each build more than the wait.
  GCC uses a precompiled header only when it is valid for the compile at hand and otherwise parses the real
  header, so a mismatch costs time, never correctness. Workers never write it: a shared header is shared code.
- in the lighter attempt below, `main.cpp` finds a light `torch/extension.h` first: torch's without the C++
  frontend (`torch/all.h`), with its own precompiled header, where the cpp_sources only declare functions
  (`light_headers.declarations_only`). The bindings then see the same pybind11 type casters (none is declared in the
  frontend), and a declaration that names a frontend type fails to compile and falls back.
- CUDA sources that name nothing of torch compile without any torch header (`light_headers.bare_cuda_arguments`:
  an empty header is found for load_inline's implicit `#include <torch/types.h>`): nvcc then parses CUDA's
  headers and the kernels only, ~1 s instead of ~25.
- a C++-only module whose sources name nothing of torch and whose bound functions take scalars is built without
  torch's header at all (`bare_cpp.build_bare_cpp`: Python's C API bindings, a stub holding the standard headers
  torch's includes, precompiled once per flags like torch's header: the standard headers are most of what is
  left to parse), ~1 s instead of ~13; any failure falls back to the candidate's own build. A CUDA module whose
  CUDA sources name nothing of torch either gets the same main.cpp and stub beside the bare CUDA unit.
- the CUDA unit: `load_inline` already puts `#include <torch/types.h>` (tensors, ATen ops, dispatch macros)
  at its top; a kernel's own `#include <torch/extension.h>` adds the C++ frontend and the Python bindings,
  which kernels rarely use and which more than double nvcc's time. `light_headers.light_cuda_sources` drops that include;
  the build worker compiles the light sources first and, on any failure, the candidate's own sources.
- that unit still parses ATen's umbrella headers, `ATen/Functions.h` and `ATen/NativeFunctions.h`: one
  `#include <ATen/ops/NAME.h>` per operator (~1,300 each). `light_headers.lean_aten_headers` writes copies, found before
  torch's, that keep the operators the sources name (and those the umbrella's own code names), and defines
  `AT_PER_OPERATOR_HEADERS` so torch's other headers include exactly the operators they use, as they do when
  torch itself is built. Every name the sources use keeps all its overloads; a name left out fails to compile,
  and the build falls back to the candidate's own sources.
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from dice_kernels.harness.compiling.bare_cpp import stub_header, torch_macro_names
from dice_kernels.harness.compiling.light_headers import light_extension_header

_TORCH_NAMESPACES = re.compile(r"\b(?:torch|at|c10)::")
# extra_cflags lists a precompiled header is built for; a candidate with other flags compiles without one
PCH_VARIANTS: tuple[tuple[str, ...], ...] = ((), ("-O3",))
# the longest a compile waits for a header being built (25-36 s of one core on the H200 machines); after that
# it goes on without
PCH_WAIT_S = 120
# where the light header serves the first attempts, torch's own serves only fallbacks (C++ units that are not
# declarations only, the candidate's own sources after a failed lighter attempt): it is built at this niceness,
# in the time the cores have to spare, instead of taking a core from the batch's first builds for half a minute
SPARE_TIME_NICE = 19

# The compiler a build worker gives torch (as CXX) while a header it could use is being built: a compile (`-c`)
# waits until the header is published, its build is over, its CUDA unit has failed or PCH_WAIT_S have passed, and
# for a spare-time header (DICE_PCH_SPARE_TIME) also until its CUDA unit has compiled: such a header progresses only
# on idle cores, so once nothing else of the build is left, parsing torch's header costs less than waiting. It
# writes what it waited to pch_wait.json in the build directory (ninja's working directory), then runs the real
# compiler unchanged, unless the CUDA unit failed: the build fails either way, and ninja would wait for this
# compile before reporting it. Links and torch's version checks pass straight through.
_WAITING_COMPILER = """#!/bin/sh
case " $* " in
*" -c "*)
    tenths=0
    while [ ! -e "$DICE_PCH_FILE" ] && [ -e "$DICE_PCH_BUILDING" ] && [ ! -e cuda_unit_failed ] \\
            && { [ -z "$DICE_PCH_SPARE_TIME" ] || [ ! -e cuda_unit_built ]; } \\
            && [ "$tenths" -lt "$DICE_PCH_WAIT_TENTHS" ]; do
        sleep 0.1
        tenths=$((tenths + 1))
    done
    found=false skipped=false
    [ -e "$DICE_PCH_FILE" ] && found=true
    [ -e cuda_unit_failed ] && skipped=true
    printf '{"waited_tenths": %d, "found": %s, "skipped": %s}\\n' "$tenths" "$found" "$skipped" > pch_wait.json
    if [ "$skipped" = true ]; then
        echo "dice-kernels: this compile was skipped: the build's CUDA unit failed to compile first" >&2
        exit 1
    fi ;;
esac
exec $DICE_PCH_REAL_CXX "$@"
"""

# The nvcc a build worker gives torch (as PYTORCH_NVCC) beside the waiting compiler: the real one, and the mark in
# the build directory of how it ended, which the waiting compiler looks for
_REPORTING_NVCC = """#!/bin/sh
$DICE_REAL_NVCC "$@"
status=$?
if [ "$status" -eq 0 ]; then : > cuda_unit_built; else : > cuda_unit_failed; fi
exit "$status"
"""

def normalize_cflags(flags) -> tuple[str, ...]:
    """extra_cflags as the compiler sees them: torch strips each flag, and empty ones add nothing."""
    if flags is None:
        return ()
    if isinstance(flags, str):
        flags = [flags]
    return tuple(f.strip() for f in flags if str(f).strip())


def torch_ninja_values(scratch: Path, sources: list[str], cflags: tuple[str, ...] = (),
                       with_cuda: bool = False) -> dict[str, str]:
    """The variables (`cxx`, `cflags`, `cuda_cflags`, ...) of the ninja file torch would write for `sources`, from
    torch itself. Its CUDA arch flags are not among them: an `-arch` of ours keeps torch from asking the GPU for
    its arch (the parent opens no CUDA context)."""
    import torch.utils.cpp_extension as cpp

    writer = cpp._write_ninja_file_to_build_library  # internal, but it is the only source of truth for the flags
    wanted = dict(path=str(scratch / "build.ninja"), name="dice_pch_probe", sources=sources,
                  extra_cflags=list(cflags), extra_cuda_cflags=["-arch=sm_90"], extra_sycl_cflags=[], extra_ldflags=[],
                  extra_include_paths=[], with_cuda=with_cuda, with_sycl=False, is_standalone=False)
    params = inspect.signature(writer).parameters
    writer(**{k: v for k, v in wanted.items() if k in params})
    values = {}
    for line in (scratch / "build.ninja").read_text().splitlines():
        name, sep, value = line.partition(" = ")
        if sep and not line.startswith(" "):
            values[name] = value
    return values


def _main_unit_command(cflags: tuple[str, ...], with_cuda: bool, scratch: Path) -> tuple[str, list[str], list[str]]:
    """(compiler, cflags, post_cflags) torch's ninja file would use for `main.cpp`, from torch itself."""
    values = torch_ninja_values(scratch, [str(scratch / "main.cpp")], cflags, with_cuda)
    flags = [f for f in shlex.split(values.get("cflags", "")) if not f.startswith("-DTORCH_EXTENSION_NAME=")]
    return values.get("cxx", "c++"), flags, shlex.split(values.get("post_cflags", ""))


@dataclass(frozen=True)
class PchPlan:
    """Where the precompiled header for one extra_cflags variant lives and the command that builds it."""

    variant: tuple[str, ...]
    root: Path  # the -I directory: root/torch/extension.h.gch
    command: list[str]  # without its input and output
    header: Path  # torch's own extension.h
    text: str | None = None  # the header's text (`light_extension_header`, the bare stub); None: torch's own header
    nice: int = 0  # how much nicer than this process its compiler runs
    kind: str = "own"  # "own" (torch's header), "light" or "bare" (`bare_cpp.stub_header`)

    @property
    def ready(self) -> bool:
        return pch_file(self.root).exists()

    @property
    def building(self) -> Path:
        """The marker that says this header is being built (`announce_pch` to the end of its `build_pch`)."""
        return building_marker(self.root)

    def unit_command(self) -> list[str]:
        """A unit's compile command with this header's compiler and flags, finding the header first (input, output
        and -D flags to add): the header's own command without `-x c++-header`."""
        x = self.command.index("-x")
        return [*self.command[:x], *self.command[x + 2:], f"-I{self.root}"]


def pch_file(root: Path) -> Path:
    return root / "torch" / "extension.h.gch"


def building_marker(root: Path) -> Path:
    """Present while the header at `root` is being built; holds its compiler's niceness (`PchPlan.nice`)."""
    return root.with_name(root.name + ".building")


def pch_variants(codes, variants=PCH_VARIANTS) -> tuple[tuple[str, ...], ...]:
    """The `variants` a batch's code may compile with: `[]` (load_inline's default) always, another only where some
    code names `extra_cflags` and each of its flags. A guess read from the text: a header no build uses costs a
    core for half a minute, and one that is missing costs only the time it would have saved."""
    texts = [c for c in codes if "extra_cflags" in c]
    return tuple(v for v in variants if not v or any(all(f in t for f in v) for t in texts))


def may_build_bare(code: str) -> bool:
    """Whether a program may take the bare C++ build (a C++-only module, or a CUDA module's main.cpp: its stub is
    the same): sources that name none of torch's C++ namespaces. A guess read from the text, as `pch_variants` is."""
    return "cpp_sources" in code and not _TORCH_NAMESPACES.search(code)


def plan_pch(cache_dir: Path, with_cuda: bool, variants=PCH_VARIANTS, light: bool = False,
             bare: bool = False) -> list[PchPlan]:
    """One plan per variant torch's flags can be read for (a variant whose flags cannot be read is left out), and
    one more per variant with `light` for the light header (torch's own is then built at SPARE_TIME_NICE: it serves
    only the fallbacks) and with `bare` for the bare C++ build's stub. Beside the stub torch's own keeps its
    priority: built in spare time, it was abandoned at the end of every short batch (an RL step's) and built at
    last, waited for, by the first batch with a program that names torch."""
    import torch

    header = Path(torch.__file__).parent / "include" / "torch" / "extension.h"
    texts: list[tuple[str, str | None]] = [("own", None)]
    if light and (text := light_extension_header(header.read_text())) is not None:
        texts.append(("light", text))
    spare_own = any(kind == "light" for kind, _ in texts)
    if bare:
        texts.append(("bare", stub_header()))
    plans = []
    for variant in variants:
        try:
            with tempfile.TemporaryDirectory(prefix="dice-pch-") as tmp:
                cxx, flags, post = _main_unit_command(variant, with_cuda, Path(tmp))
            command = [*shlex.split(cxx), "-x", "c++-header", *flags, *post]
            compiler = _compiler_id(cxx)
        except (OSError, subprocess.SubprocessError, ValueError, AttributeError, TypeError):
            continue
        for kind, text in texts:
            key = hashlib.sha256(json.dumps([command, compiler, torch.__version__, header.stat().st_mtime_ns,
                                             text]).encode()).hexdigest()[:24]
            nice = SPARE_TIME_NICE if kind == "own" and spare_own else 0
            plans.append(PchPlan(variant, cache_dir / "pch" / key, command, header, text, nice, kind))
    return plans


def planned_pch(plans: list[PchPlan], kind: str = "own") -> dict[str, str]:
    """{json(extra_cflags): include dir} for every plan of one header kind ("own": torch's, "light", "bare"), ready
    or not: what build workers are given (a compile that finds no precompiled header there parses the header
    beside it; a bare build whose stub is not published yet writes its own)."""
    return {json.dumps(list(p.variant)): str(p.root) for p in plans if p.kind == kind}


def ready_pch(plans: list[PchPlan]) -> dict[str, str]:
    """`planned_pch` of the plans whose header is built (torch's own header's: what `build_pch` reports)."""
    return planned_pch([p for p in plans if p.ready])


def announce_pch(plans: list[PchPlan], cache_dir: Path) -> str | None:
    """Mark the headers not yet built as being built, so compiles that could use them wait (`build_pch` takes
    the marks away); returns the waiting compiler's path, or None when every header is ready. Called before any
    build worker starts."""
    missing = [p for p in plans if not p.ready]
    if not missing:
        return None
    compiler = cache_dir / "pch" / "waiting-compiler.sh"
    for script, text in ((compiler, _WAITING_COMPILER), (reporting_nvcc(str(compiler)), _REPORTING_NVCC)):
        script.parent.mkdir(parents=True, exist_ok=True)
        if not script.exists() or script.read_text() != text:
            staging = script.with_name(f".{script.name}.{os.getpid()}")
            staging.write_text(text)
            staging.chmod(0o755)
            os.replace(staging, script)
    for plan in missing:
        plan.building.write_text(str(plan.nice))
    return str(compiler)


def reporting_nvcc(compiler: str) -> Path:
    """The nvcc wrapper `announce_pch` writes beside the waiting `compiler`."""
    return Path(compiler).with_name("reporting-nvcc.sh")


def pch_wait_environment(pch_dir: str, compiler: str | None, nvcc: str | None = None) -> dict[str, str] | None:
    """The environment that makes torch compile through the waiting compiler, for a build whose header at
    `pch_dir` is being built now; None when it is ready or nobody is building it. With `nvcc` (the command torch
    would run for the build's CUDA unit), that unit compiles through the reporting nvcc, so its end can end the
    wait. A header built in spare time (its marker's niceness above 0) is waited for only while the CUDA unit
    compiles: None without one."""
    root = Path(pch_dir)
    if compiler is None or pch_file(root).exists():
        return None
    try:
        spare_time = int(building_marker(root).read_text() or 0) > 0
    except (OSError, ValueError):  # nobody is building it (or the mark is not ours): nothing to wait for
        return None
    if any(c.isspace() for c in compiler):  # torch writes CXX and PYTORCH_NVCC into shell commands unquoted
        return None
    if spare_time and not nvcc:
        return None
    env = {"CXX": compiler, "DICE_PCH_REAL_CXX": os.environ.get("CXX", "c++"), "DICE_PCH_FILE": str(pch_file(root)),
           "DICE_PCH_BUILDING": str(building_marker(root)), "DICE_PCH_WAIT_TENTHS": str(PCH_WAIT_S * 10)}
    if nvcc:
        env.update(PYTORCH_NVCC=str(reporting_nvcc(compiler)), DICE_REAL_NVCC=nvcc)
    if spare_time:
        env["DICE_PCH_SPARE_TIME"] = "1"
    return env


def read_pch_wait(build_dir: Path) -> dict | None:
    """What the waiting compiler wrote in `build_dir`: {"waited_s", "found", "skipped"}, or None where it did not
    run. `skipped`: the compile did not run, because the CUDA unit had failed."""
    try:
        record = json.loads((build_dir / "pch_wait.json").read_text())
        return {"waited_s": record["waited_tenths"] / 10, "found": bool(record["found"]),
                "skipped": bool(record["skipped"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def build_pch(plans: list[PchPlan], abandon: threading.Event | None = None) -> dict[str, str]:
    """Build the missing headers (in parallel); returns `ready_pch` after. A header that fails is left out, and so
    is a spare-time one (`nice` above 0) still being built when `abandon` is set: the batch that planned it is
    over, and it would only hold that batch's caller for the rest of its build."""
    missing = [p for p in plans if not p.ready]
    with ThreadPoolExecutor(max(1, len(missing))) as pool:
        list(pool.map(lambda plan: _try_build(plan, abandon if plan.nice > 0 else None), missing))
    return ready_pch(plans)


def pch_lock(root: Path) -> Path:
    """The lock whose holder builds the header at `root`: processes on one cache (the test suite's two workers, a
    reward service beside `dice eval`) each planned it, and one builds it while the others wait for it (their
    builds wait on the same mark), instead of each compiling the same ~790 MB header on cores the builds need."""
    return root.with_name(root.name + ".lock")


def _try_build(plan: PchPlan, abandon: threading.Event | None) -> None:
    try:
        plan.root.parent.mkdir(parents=True, exist_ok=True)
        lock = open(pch_lock(plan.root), "a")
    except OSError:
        lock = None  # nothing to share the build through: build it here
    try:
        if lock is not None and not _lock_unless_abandoned(lock, abandon):
            return  # abandoned while another process builds it: that one takes the mark away when it is done
        try:
            if not plan.ready:  # another process may have published it meanwhile
                if lock is not None:  # and one whose build failed took the mark away
                    plan.building.write_text(str(plan.nice))
                _build_pch(plan, abandon)
        except (OSError, subprocess.SubprocessError):
            pass
        finally:  # published, failed or abandoned: nobody waits any longer
            plan.building.unlink(missing_ok=True)
    finally:
        if lock is not None:
            lock.close()  # releases the lock


def _lock_unless_abandoned(lock, abandon: threading.Event | None) -> bool:
    """Take `lock` (an open file) for this header's build; False when `abandon` was set first."""
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if abandon is not None and abandon.is_set():
                return False
            time.sleep(0.1)


def _run_unless_abandoned(command: list[str], abandon: threading.Event | None, timeout_s: float) -> bool:
    """Run `command` to success (raises where it fails or times out); False when `abandon` was set first, and then
    the command and every process it started have been killed."""
    # its own process group: the compiler driver's children (cc1plus) are killed with it
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                returncode = proc.wait(timeout=0.1)  # the batch's end waits for this check
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    raise
                if abandon is not None and abandon.is_set():
                    return False
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if returncode:
        raise subprocess.CalledProcessError(returncode, command)
    return True


def torch_macros_file(cache_dir: Path) -> Path:
    """Where the parent stores `bare_cpp.torch_macro_names` for this torch and compiler (`store_torch_macros`): a
    bare build that fails asks whether torch's header could have mended it, and reading the names through the
    preprocessor costs each build worker ~2 s of a core."""
    import torch
    import torch.utils.cpp_extension as cpp

    header = Path(torch.__file__).parent / "include" / "torch" / "extension.h"
    key = hashlib.sha256(json.dumps([torch.__version__, header.stat().st_mtime_ns,
                                     _compiler_id(cpp.get_cxx_compiler())]).encode()).hexdigest()[:24]
    return cache_dir / "pch" / f"torch-macros-{key}.json"


def store_torch_macros(path: Path) -> None:
    """Write torch's macro names to `path` once (workers read it, never write it); nothing when they cannot be read."""
    if path.exists() or (names := torch_macro_names()) is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(json.dumps(sorted(names)))
    os.replace(staging, path)


@cache  # a batch asks once per header variant and again for torch's macro names: one `--version` a process
def _compiler_id(cxx: str) -> str:
    out = subprocess.run([*shlex.split(cxx), "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.splitlines()[0] if out.stdout else cxx


def _build_pch(plan: PchPlan, abandon: threading.Event | None = None) -> None:
    root = plan.root
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        (staging / "torch").mkdir()
        # GCC looks for the .gch beside where it finds the header; a second `#include <torch/extension.h>` in the
        # same unit (common in cpp_sources) must then find the header itself here too
        source = staging / "torch" / "extension.h"
        if plan.text is None:
            source.symlink_to(plan.header)
        else:
            source.write_text(plan.text)
        command = [*plan.command, str(plan.header if plan.text is None else source)]
        niced = ["nice", "-n", str(plan.nice)] if plan.nice else []  # the compiler the driver starts inherits it
        if not _run_unless_abandoned([*niced, *command, "-o", str(pch_file(staging))], abandon, timeout_s=900):
            return
        (staging / "command.json").write_text(json.dumps(command))
        os.replace(staging, root)
    except OSError:  # another process published the same header first
        if not pch_file(root).exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)

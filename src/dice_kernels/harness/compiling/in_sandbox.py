"""The build side of a worker: a candidate's module executed with every `load_inline`/`load` routed through the
content-addressed build cache (`patch_extension_loaders`), the build speed-ups' attempts (compiling/speed.py) in a
build job, and what a candidate's code raised classified into an outcome (`classify`). Imported by worker/main.py,
which runs in the sandboxed process only."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import sys
import time
import traceback
import types
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dice_kernels.harness.outcomes import Outcome
from dice_kernels.harness.process.protocol import BuildJob, RunJob

if TYPE_CHECKING:
    from dice_kernels.harness.robust.integrity import Monitor

MEMORY_ERROR_PATTERNS = re.compile(
    r"illegal memory access|out of memory|misaligned address|illegal address|invalid address|address space|"
    r"unspecified launch failure|CUBLAS_STATUS_ALLOC_FAILED|"
    r"std::bad_alloc|Cannot allocate memory|MemoryError", re.IGNORECASE)
# the host's memory, not the device's: a worker over its --sandbox-memory-limit-gb (RLIMIT_AS) or the machine's
HOST_MEMORY_PATTERNS = re.compile(r"std::bad_alloc|Cannot allocate memory|can't allocate memory|MemoryError|"
                                  r"DefaultCPUAllocator", re.IGNORECASE)
_MAX_ERROR = 4000
HOST_MEMORY_ERROR = Outcome.MEMORY_ERROR.value  # host memory exhausted, not a CUDA fault



class StageError(Exception):
    """An error attributed to the candidate, tagged with its outcome kind and the phase it happened in."""

    def __init__(self, kind: str, phase: str, message: str, deceptive_kind: str = ""):
        super().__init__(message)
        self.kind, self.phase, self.message, self.deceptive_kind = kind, phase, message, deceptive_kind


@dataclass
class BuildLog:
    """What the patched `load_inline`/`load` did in this process (kept even if the candidate swallows errors)."""

    built: list[dict] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    compile_s: float = 0.0
    shortcuts: list[dict] = field(default_factory=list)  # per build: which build_speed savings applied


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", str(name))[:64] or "ext"


def patch_extension_loaders(job: BuildJob | RunJob, log: BuildLog, monitor: Monitor | None) -> None:
    """Route every `load_inline`/`load` call through the content-addressed build cache.

    build mode compiles into `build_dir/<name>`; run mode imports what the build produced (the cache is
    read-only to it) and only compiles, into its private directory, extensions the build never saw. With a
    monitor, the returned modules are wrapped so calls into them are counted.
    """
    import torch.utils.cpp_extension as cpp

    building = isinstance(job, BuildJob)
    torch_load = cpp.load  # what a bare C++ build calls: torch's own, not the patched one below
    build_dir = job.build_dir if building else (job.candidate.build_dir if job.candidate else None)
    manifest: dict[str, dict] = {}
    if not building and build_dir and (Path(build_dir) / "manifest.json").exists():
        manifest = {e["key"]: e for e in json.loads((Path(build_dir) / "manifest.json").read_text())["built"]}
    counts: dict[str, int] = {}

    def wrap(original):
        signature = inspect.signature(original)

        def patched(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            name = _safe_name(bound.arguments["name"])
            counts[name] = counts.get(name, 0) + 1
            key = f"{name}#{counts[name]}"
            is_python_module = bound.arguments.get("is_python_module", True)
            if key in manifest:
                entry = manifest[key]
                module = cpp._import_module_from_library(entry["module"], str(Path(build_dir) / entry["dir"]),
                                                         is_python_module)
                return monitor.wrap_extension(module, name) if monitor else module
            root = Path(build_dir) if building else Path(job.workdir) / "late_builds"
            bound.arguments["verbose"] = False
            attempts = _build_attempts(job, bound.arguments, root / f"{name}_{counts[name]}", log, key, torch_load)
            start = time.monotonic()
            try:
                # torch's build writes and reads files: the harness's doing, wherever the candidate calls it from
                with monitor.harness_io() if monitor else nullcontext():
                    module, attempt = _build_in_order(original, attempts, log)
            except BaseException as e:  # noqa: BLE001 - recorded, then re-raised to the candidate
                log.failures.append(excerpt(str(e)))
                raise
            finally:
                log.compile_s += time.monotonic() - start
            module_name = module.__name__ if isinstance(module, types.ModuleType) else name
            log.built.append({"key": key, "module": module_name, "dir": str(attempt.directory.relative_to(root))})
            return monitor.wrap_extension(module, name) if monitor else module

        patched.__wrapped__ = original
        return patched

    cpp.load_inline = wrap(cpp.load_inline)
    cpp.load = wrap(cpp.load)


def _build_in_order(original, attempts: list["_Attempt"], log: BuildLog):
    """Build with each attempt in turn until one succeeds (the last one's failure is raised); (module, attempt)."""
    for n, attempt in enumerate(attempts, 1):
        attempt.directory.mkdir(parents=True, exist_ok=True)
        log.shortcuts[-1]["headers"].append(attempt.headers)
        try:
            with _environment(attempt.env):
                build = attempt.builder or original
                return build(**{**attempt.arguments, "build_directory": str(attempt.directory)}), attempt
        except Exception:  # noqa: BLE001 - a lighter attempt failed: the next one decides
            # ... unless this failure would be torch's own build's too (a bare C++ build's compile error)
            if n == len(attempts) or (attempt.conclusive and attempt.conclusive()):
                raise
        finally:
            _note_pch_wait(log.shortcuts[-1], attempt.directory)
    raise AssertionError("no build attempt")  # _build_attempts always returns at least one


@dataclass(frozen=True)
class _Attempt:
    """One try at building an extension: the torch headers it compiles with (`_build_attempts`), torch's arguments,
    the build directory, the environment it compiles in (None: as it is), what builds it (None: torch's own
    `load_inline`/`load`) and whether its failure would be torch's own build's too (None: never asked), so that the
    attempts after it need not run."""

    headers: str
    arguments: dict
    directory: Path
    env: dict[str, str] | None = None
    builder: Callable | None = None
    conclusive: Callable[[], bool] | None = None


def _build_attempts(job: BuildJob | RunJob, arguments: dict, out: Path, log: BuildLog, key: str,
                    torch_load: Callable | None = None) -> list[_Attempt]:
    """The attempts in order, the last the candidate's own sources. `headers` names the torch headers of the CUDA unit
    or of a C++-only module (compiling/speed.py): "bare" (none: sources that name nothing of torch; a C++-only module
    is then built on Python's C API, compiling/bare_cpp.py), "bare-module" (none in either unit of a CUDA module:
    the bare CUDA unit, and main.cpp on Python's C API with the stub header as a bare C++-only module's, where the
    bound functions take scalars; it takes the place of "bare", and its failure decides nothing: "bare-wide", then
    the candidate's own sources follow), "lean" (light sources, ATen's umbrellas cut to the operators they name),
    "light" (without <torch/extension.h>; only where the lean umbrellas cannot be written) or "own". A lighter
    attempt's main.cpp takes the light torch/extension.h where the cpp_sources only declare functions. One lighter
    attempt, not two: a candidate with a real compile error pays for every attempt, and on the H200 the lean headers
    compiled all 16 DICE kernels measured (`8c4f433`). The exception is "bare-wide" after "bare" or "bare-module"
    (compiling/bare_cuda.py), once the parent has measured torch's surroundings: its failure is final for sources
    that use none of torch's macros, so a compile error costs ~2.4 s of nvcc instead of ~9.4."""
    log.shortcuts.append({"key": key, "pch": False, "headers": []})
    if not isinstance(job, BuildJob) or "cpp_sources" not in arguments:  # only load_inline builds take the shortcuts
        return [_Attempt("own", arguments, out)]
    from dice_kernels.harness.compiling import bare_cuda
    from dice_kernels.harness.compiling.bare_cpp import bare_failure_is_final, build_bare_cpp, scalar_functions
    from dice_kernels.harness.compiling.speed import normalize_cflags, pch_file, pch_wait_environment
    from dice_kernels.harness.compiling.light_headers import (bare_cuda_arguments, declarations_only,
                                                              lean_cuda_arguments, light_cuda_sources)

    variant = json.dumps(list(normalize_cflags(arguments.get("extra_cflags"))))

    full = (job.pch or {}).get(variant)
    nvcc = bare_cuda.torch_nvcc() if arguments.get("cuda_sources") else None

    def attempt(headers: str, args: dict, directory: Path, pch_dir: str | None) -> _Attempt:
        """main.cpp finds the header at `pch_dir` before torch's (GCC ignores its precompiled form wherever it
        would not be valid), and waits for it while it is being built (a spare-time one: while the CUDA unit
        compiles)."""
        if not pch_dir:
            return _Attempt(headers, args, directory)
        args = {**args, "extra_cflags": [*(args.get("extra_cflags") or []), f"-I{pch_dir}"]}
        return _Attempt(headers, args, directory, pch_wait_environment(pch_dir, job.pch_compiler, nvcc))

    def bare_module(headers: str, conclusive: Callable[[], bool] | None = None) -> _Attempt:
        """The module built on Python's C API with the stub header (compiling/bare_cpp.py), found where the parent
        publishes it with its precompiled form."""
        stub = (job.pch_bare or {}).get(variant)
        log.shortcuts[-1]["pch"] = bool(stub) and pch_file(Path(stub)).exists()
        return _Attempt(headers, {**arguments, "load": torch_load, "stub_dir": stub}, out, builder=build_bare_cpp,
                        conclusive=conclusive)

    own = attempt("own", dict(arguments), out, full)
    log.shortcuts[-1]["pch"] = bool(full) and pch_file(Path(full)).exists()
    if job.light_headers and scalar_functions(arguments):
        return [bare_module("bare", lambda: bare_failure_is_final(arguments["cpp_sources"], job.torch_macros)),
                replace(own, directory=out.with_name(out.name + "_own"))]
    bare = bare_cuda_arguments(arguments, out.with_name(out.name + "_bare_include")) if job.light_headers else None
    lean = (lean_cuda_arguments(arguments, out.with_name(out.name + "_lean_include"))
            if job.light_headers and bare is None else None)
    light = light_cuda_sources(arguments.get("cuda_sources")) if job.light_headers else None
    if bare is not None:
        first = ("bare", bare)
    elif lean is not None:
        first = ("lean", lean)
    elif light is not None:
        first = ("light", {**arguments, "cuda_sources": light})
    else:
        return [own]
    light_main = (job.pch_light or {}).get(variant) if declarations_only(arguments["cpp_sources"]) else None
    if light_main:
        log.shortcuts[-1].update(light_main=True, pch=pch_file(Path(light_main)).exists())
    if first[0] == "bare" and scalar_functions(arguments, cuda=True):
        attempts = [bare_module("bare-module")]
    else:
        attempts = [attempt(*first, out, light_main or full)]
    if first[0] == "bare" and (around := bare_cuda.load(job.cuda_surroundings)):
        # the bare attempt's failure, again with the standard and CUDA headers torch's would bring: if that fails
        # too, torch's header could not have mended it
        wide = bare_cuda_arguments(arguments, out.with_name(out.name + "_wide_include"), around.stub())
        attempts.append(replace(attempt("bare-wide", wide, out.with_name(out.name + "_wide"), light_main or full),
                                conclusive=lambda: bare_cuda.failure_is_final(arguments["cuda_sources"], around)))
    return [*attempts, replace(own, directory=out.with_name(out.name + "_own"))]


@contextmanager
def _environment(env: dict[str, str] | None):
    """Environment variables set for the duration of a `with` block (nothing when None)."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _note_pch_wait(shortcut: dict, directory: Path) -> None:
    """Add what the waiting compiler did in `directory` (if it ran) to the build's record."""
    from dice_kernels.harness.compiling.speed import read_pch_wait

    wait = read_pch_wait(directory)
    if wait is not None:
        shortcut["pch"] = wait["found"]
        shortcut["pch_wait_s"] = round(shortcut.get("pch_wait_s", 0.0) + wait["waited_s"], 1)
        if wait["skipped"]:  # the attempt failed in its CUDA unit, and main.cpp was not compiled
            shortcut["main_skipped"] = shortcut.get("main_skipped", 0) + 1


def excerpt(text: str) -> str:
    """The informative part of a long error: compiler `error` lines first, else the tail."""
    lines = text.splitlines()
    errors = [ln for ln in lines if re.search(r"\berror\s*:", ln, re.IGNORECASE)]
    if errors:
        text = "\n".join([lines[0].split(": [")[0], *errors[:20]])
    return text[-_MAX_ERROR:]


def load_module(name: str, path: str, preset: types.ModuleType | None = None) -> types.ModuleType:
    """Execute the file at `path` as module `name`, its namespace first filled with `preset`'s globals."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if preset is not None:
        module.__dict__.update({k: v for k, v in vars(preset).items() if not k.startswith("__")})
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def classify(exc: BaseException, phase: str, log: BuildLog) -> StageError:
    if isinstance(exc, StageError):
        return exc
    message = excerpt("".join(traceback.format_exception_only(type(exc), exc)).strip())
    if log.failures:
        return StageError("compile_error", "build", log.failures[0])
    if isinstance(exc, SystemExit):
        return StageError("python_error", phase, f"candidate called sys.exit({exc.code!r})")
    if isinstance(exc, MemoryError) or HOST_MEMORY_PATTERNS.search(message):
        return StageError(HOST_MEMORY_ERROR, phase, message)
    if MEMORY_ERROR_PATTERNS.search(message):
        return StageError("cuda_memory_error", phase, message)
    if phase in ("import", "init") or isinstance(exc, (AttributeError, NameError, ImportError, SyntaxError)):
        return StageError("python_error", phase, message)
    return StageError("runtime_error", phase, message)


def build(job: BuildJob, log: BuildLog) -> dict:
    """Execute the candidate module once so its `load_inline` calls compile into the build cache."""
    try:
        load_module("dice_candidate", job.candidate_path)
    except BaseException as e:  # noqa: BLE001
        err = classify(e, "import", log)
        return {"status": "error", "kind": err.kind, "phase": err.phase, "error": err.message}
    if log.failures:
        return {"status": "error", "kind": "compile_error", "phase": "build", "error": log.failures[0]}
    return {"status": "ok"}



"""The sandboxed worker: the only process that executes task or candidate code.

`python -m dice_kernels.harness.worker JOB.json` confines itself (sandbox.confine), then either builds a
candidate's extensions into the build cache (mode "build") or runs a model on seeded inputs (mode "run":
the task's `Model` for role "reference", the candidate's `ModelNew` for role "candidate"), writing
`result.json` into its private directory and its outputs into a pipe to the parent (tensor_stream). It never
sees reference outputs: the parent compares.
"""

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
from dataclasses import dataclass, field
from pathlib import Path

from dice_kernels.harness.sandbox import OUTPUT_FD_ENV, Limits, confine
from dice_kernels.harness.tensor_stream import write_trials

_MEMORY_PATTERNS = re.compile(
    r"illegal memory access|out of memory|misaligned address|illegal address|invalid address|address space|"
    r"unspecified launch failure|CUBLAS_STATUS_ALLOC_FAILED|"
    r"std::bad_alloc|Cannot allocate memory|MemoryError", re.IGNORECASE)
_MAX_ERROR = 4000


@dataclass
class Job:
    mode: str  # "build" | "run"
    role: str  # "reference" | "candidate"
    workdir: str
    task_path: str
    candidate_path: str | None
    build_dir: str | None
    device: str
    seed: int
    trials: int
    timing: bool
    warmup: int
    iters: int
    limits: dict
    timing_lock: str | None = None  # file whose flock serialises timing across concurrent workers

    @classmethod
    def read(cls, path: str) -> "Job":
        return cls(**json.loads(Path(path).read_text()))


class StageError(Exception):
    """An error attributed to the candidate, tagged with its outcome kind and the phase it happened in."""

    def __init__(self, kind: str, phase: str, message: str):
        super().__init__(message)
        self.kind, self.phase, self.message = kind, phase, message


@dataclass
class BuildLog:
    """What the patched `load_inline`/`load` did in this process (kept even if the candidate swallows errors)."""

    built: list[dict] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    compile_s: float = 0.0


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", str(name))[:64] or "ext"


def _patch_extension_loaders(job: Job, log: BuildLog) -> None:
    """Route every `load_inline`/`load` call through the content-addressed build cache.

    build mode compiles into `build_dir/<name>`; run mode imports what the build produced (the cache is
    read-only to it) and only compiles, into its private directory, extensions the build never saw.
    """
    import torch.utils.cpp_extension as cpp

    manifest: dict[str, dict] = {}
    if job.mode == "run" and job.build_dir and (Path(job.build_dir) / "manifest.json").exists():
        manifest = {e["key"]: e for e in json.loads((Path(job.build_dir) / "manifest.json").read_text())["built"]}
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
                return cpp._import_module_from_library(entry["module"], str(Path(job.build_dir) / entry["dir"]),
                                                       is_python_module)
            root = Path(job.build_dir) if job.mode == "build" else Path(job.workdir) / "late_builds"
            out = root / f"{name}_{counts[name]}"
            out.mkdir(parents=True, exist_ok=True)
            bound.arguments["build_directory"] = str(out)
            bound.arguments["verbose"] = False
            start = time.monotonic()
            try:
                module = original(*bound.args, **bound.kwargs)
            except BaseException as e:  # noqa: BLE001 - recorded, then re-raised to the candidate
                log.failures.append(_excerpt(str(e)))
                raise
            finally:
                log.compile_s += time.monotonic() - start
            module_name = module.__name__ if isinstance(module, types.ModuleType) else name
            log.built.append({"key": key, "module": module_name, "dir": str(out.relative_to(root))})
            return module

        patched.__wrapped__ = original
        return patched

    cpp.load_inline = wrap(cpp.load_inline)
    cpp.load = wrap(cpp.load)


def _excerpt(text: str) -> str:
    """The informative part of a long error: compiler `error` lines first, else the tail."""
    lines = text.splitlines()
    errors = [ln for ln in lines if re.search(r"\berror\s*:", ln, re.IGNORECASE)]
    if errors:
        text = "\n".join([lines[0].split(": [")[0], *errors[:20]])
    return text[-_MAX_ERROR:]


def _load_module(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _classify(exc: BaseException, phase: str, log: BuildLog) -> StageError:
    if isinstance(exc, StageError):
        return exc
    message = _excerpt("".join(traceback.format_exception_only(type(exc), exc)).strip())
    if log.failures:
        return StageError("compile_error", "build", log.failures[0])
    if isinstance(exc, SystemExit):
        return StageError("python_error", phase, f"candidate called sys.exit({exc.code!r})")
    if isinstance(exc, MemoryError) or _MEMORY_PATTERNS.search(message):
        return StageError("cuda_memory_error", phase, message)
    if phase in ("import", "init") or isinstance(exc, (AttributeError, NameError, ImportError, SyntaxError)):
        return StageError("python_error", phase, message)
    return StageError("runtime_error", phase, message)


def _flatten(out, where: str) -> list:
    import torch

    if isinstance(out, torch.Tensor):
        if type(out) is not torch.Tensor and not isinstance(out, torch.nn.Parameter):
            raise StageError("python_error", "forward",
                             f"{where} returned a tensor subclass ({type(out).__name__}); only plain tensors count")
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _flatten(item, where)]
    if isinstance(out, (int, float, bool)):
        return [torch.tensor(out)]
    raise StageError("python_error", "forward", f"{where} returned {type(out).__name__}, not tensors")


def _check_signature(cls: type, reference: type, init_inputs: list) -> None:
    """ModelNew must take the task's init inputs and the same forward arguments as Model."""
    try:
        inspect.signature(cls).bind(*init_inputs)
    except TypeError as e:
        raise StageError("python_error", "init",
                         f"ModelNew's constructor does not accept the task's get_init_inputs() ({e})") from None
    try:
        ours = inspect.signature(cls.forward)
        theirs = inspect.signature(reference.forward)
    except (TypeError, ValueError):
        return
    required = [p for p in theirs.parameters.values() if p.name != "self" and p.kind in
                (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    try:
        ours.bind(None, *[object()] * len(required))
    except TypeError as e:
        raise StageError("python_error", "init",
                         f"ModelNew.forward does not accept Model.forward's {len(required)} arguments ({e})") from None


def _seed_all(seed: int) -> None:
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:
        pass


def _to_device(x, device):
    import torch

    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(v, device) for v in x)
    return x


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time_forward(model, inputs, job: Job) -> dict:
    """Median per-call time, measured while holding the timing lock so no other worker's timing overlaps."""
    if not job.timing_lock:
        return _timed_loop(model, inputs, job)
    import fcntl

    with open(job.timing_lock) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _timed_loop(model, inputs, job)


def _timed_loop(model, inputs, job: Job) -> dict:
    """CUDA events on GPU, monotonic clock on CPU; plus a host-clock mean across a full synchronize."""
    import torch

    for _ in range(job.warmup):
        model(*inputs)
    _sync(job.device)
    times = []
    host_start = time.perf_counter()
    if job.device.startswith("cuda"):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(job.iters)]
        for start, end in events:
            start.record()
            model(*inputs)
            end.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(job.iters):
            t0 = time.perf_counter()
            model(*inputs)
            times.append((time.perf_counter() - t0) * 1e3)
    host_ms = (time.perf_counter() - host_start) * 1e3 / job.iters
    times.sort()
    return {"time_ms": times[len(times) // 2], "times_ms": times, "host_ms": host_ms}


def run_model(job: Job, log: BuildLog) -> dict:
    import torch

    phase = "import"
    try:
        task = _load_module("dice_task", job.task_path)
        reference_cls = task.Model
        if job.role == "candidate":
            candidate = _load_module("dice_candidate", job.candidate_path)
            if log.failures:
                raise StageError("compile_error", "build", log.failures[0])
            cls = getattr(candidate, "ModelNew", None)
            if not isinstance(cls, type):
                raise StageError("python_error", "import", "the solution does not define class ModelNew")
        else:
            cls = reference_cls
        phase = "init"
        _seed_all(job.seed)
        init_inputs = list(task.get_init_inputs())
        if job.role == "candidate":
            _check_signature(cls, reference_cls, init_inputs)
        _seed_all(job.seed)
        model = cls(*init_inputs)
        if isinstance(model, torch.nn.Module):
            model = model.to(job.device).eval()
        phase = "forward"
        outputs = []
        with torch.no_grad():
            for trial in range(job.trials):
                _seed_all(job.seed + 1 + trial)
                inputs = _to_device(list(task.get_inputs()), job.device)
                result = model(*inputs)
                _sync(job.device)
                outputs.append([t.detach().to("cpu", copy=True) for t in _flatten(result, cls.__name__ + ".forward")])
            timing = {}
            if job.timing:
                phase = "timing"
                _seed_all(job.seed + 1)
                inputs = _to_device(list(task.get_inputs()), job.device)
                timing = _time_forward(model, inputs, job)
        with os.fdopen(int(os.environ.pop(OUTPUT_FD_ENV)), "wb") as stream:
            write_trials(stream, outputs)
        return {"status": "ok", "trials": len(outputs), **timing}
    except BaseException as e:  # noqa: BLE001 - everything the candidate raises becomes an outcome
        err = _classify(e, phase, log)
        return {"status": "error", "kind": err.kind, "phase": err.phase, "error": err.message}


def build(job: Job, log: BuildLog) -> dict:
    """Execute the candidate module once so its `load_inline` calls compile into the build cache."""
    try:
        _load_module("dice_candidate", job.candidate_path)
    except BaseException as e:  # noqa: BLE001
        err = _classify(e, "import", log)
        return {"status": "error", "kind": err.kind, "phase": err.phase, "error": err.message}
    if log.failures:
        return {"status": "error", "kind": "compile_error", "phase": "build", "error": log.failures[0]}
    return {"status": "ok"}


def main(job_path: str) -> None:
    job = Job.read(job_path)
    notes = confine(Limits(**{**job.limits, "writable": tuple(job.limits["writable"])}))
    log = BuildLog()
    _patch_extension_loaders(job, log)
    result = build(job, log) if job.mode == "build" else run_model(job, log)
    result.update(built=log.built, compile_s=log.compile_s, sandbox=notes)
    # Written last and atomically: a worker that dies earlier leaves no result and the parent says so.
    tmp = Path(job.workdir) / "result.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, Path(job.workdir) / "result.json")
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: candidate atexit hooks and destructors must not run after the report


if __name__ == "__main__":
    main(sys.argv[1])

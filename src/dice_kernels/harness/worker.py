"""The sandboxed worker: the only process that executes task or candidate code.

`python -m dice_kernels.harness.worker` imports what it needs, reads its job path from stdin (the parent may
start it before the job exists), confines itself (sandbox.confine), then either builds a
candidate's extensions into the build cache (mode "build") or runs a model on seeded inputs (mode "run":
the task's `Model` for role "reference", the candidate's `ModelNew` for role "candidate"), writing
`result.json` into its private directory and its outputs into a pipe to the parent (tensor_stream). It never
sees reference outputs: the parent compares.

Trial protocol (both roles, so outputs line up): trial k runs on inputs seeded `seed + 1 + k`; odd trials write
their values into the previous trial's input tensors (same pointers, new content) so caching keyed on pointers
shows. With timing on, one more output follows the trials: the last timing-loop iteration's, on inputs rewritten
in place just before it. A candidate worker with the robust check on also runs `integrity.Monitor`.
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
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

# timing binds the clocks it uses at import, before any candidate code could replace them
from dice_kernels.harness import gpu_lock, timing
from dice_kernels.harness.sandbox import OUTPUT_FD_ENV, Limits, confine
from dice_kernels.harness.tensor_stream import write_trials

if TYPE_CHECKING:
    from dice_kernels.harness.integrity import Monitor

MEMORY_ERROR_PATTERNS = re.compile(
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
    timing_plan: dict
    limits: dict
    gpu_lock: str | None = None  # gpu_lock.create prefix: correctness calls share the device, timing has it alone
    robust: dict | None = None  # candidate role: {"allowed_ops": [...], "min_extension_gpu_share": float}
    atol: float = 0.0  # tolerances, for the reference's degenerate-task check (does an input copy pass?)
    rtol: float = 0.0
    pch: dict | None = None  # build mode: {json(extra_cflags): include dir of a precompiled torch/extension.h}
    pch_light: dict | None = None  # build mode: the same for the light torch/extension.h (build_speed.py)
    pch_compiler: str | None = None  # build mode: build_speed.announce_pch's, while some header is being built
    light_headers: bool = False  # build mode: try lighter torch headers for CUDA sources first (build_speed.py)
    compile_baseline: bool = False  # reference role: also time torch.compile(Model) with the same protocol
    # reference role: report the task's speed-of-light inputs (FLOPs, minimum bytes moved) and measure the
    # device's ceilings for the task's dtype unless the parent already has them (dtype names it has)
    speed_of_light: bool = False
    ceilings_known: list = field(default_factory=list)
    # reference role: the parent has this task's baseline (harness/baselines.py), so nothing is timed; the
    # worker still computes the trials and the re-checked call's outputs, which are never cached
    baseline_cached: bool = False
    # candidate role: after the trials, wait for the parent's verdict on their outputs; only candidates whose
    # trials are right are timed and profiled (nothing about a wrong one depends on its time or GPU share)
    verdict: bool = False
    # call get_inputs() with the device as torch's default device (`_generated_inputs`)
    inputs_on_device: bool = False

    @classmethod
    def read(cls, path: str) -> "Job":
        return cls(**json.loads(Path(path).read_text()))


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


def _patch_extension_loaders(job: Job, log: BuildLog, monitor: Monitor | None) -> None:
    """Route every `load_inline`/`load` call through the content-addressed build cache.

    build mode compiles into `build_dir/<name>`; run mode imports what the build produced (the cache is
    read-only to it) and only compiles, into its private directory, extensions the build never saw. With a
    monitor, the returned modules are wrapped so calls into them are counted.
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
                module = cpp._import_module_from_library(entry["module"], str(Path(job.build_dir) / entry["dir"]),
                                                         is_python_module)
                return monitor.wrap_extension(module, name) if monitor else module
            root = Path(job.build_dir) if job.mode == "build" else Path(job.workdir) / "late_builds"
            bound.arguments["verbose"] = False
            attempts = _build_attempts(job, bound.arguments, root / f"{name}_{counts[name]}", log, key)
            start = time.monotonic()
            try:
                for n, attempt in enumerate(attempts, 1):
                    attempt.directory.mkdir(parents=True, exist_ok=True)
                    log.shortcuts[-1]["headers"].append(attempt.headers)
                    try:
                        with _environment(attempt.env):
                            module = original(**{**attempt.arguments, "build_directory": str(attempt.directory)})
                        break
                    except Exception:  # noqa: BLE001 - a lighter attempt failed: the next one decides
                        if n == len(attempts):
                            raise
                    finally:
                        _note_pch_wait(log.shortcuts[-1], attempt.directory)
            except BaseException as e:  # noqa: BLE001 - recorded, then re-raised to the candidate
                log.failures.append(_excerpt(str(e)))
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


@dataclass(frozen=True)
class _Attempt:
    """One try at building an extension: the CUDA unit's torch headers (`_build_attempts`), torch's arguments, the
    build directory, and the environment it compiles in (None: as it is)."""

    headers: str
    arguments: dict
    directory: Path
    env: dict[str, str] | None = None


def _build_attempts(job: Job, arguments: dict, out: Path, log: BuildLog, key: str) -> list[_Attempt]:
    """The attempts in order, the last the candidate's own sources. `headers` names the CUDA unit's torch headers
    (build_speed.py): "lean" (light sources, ATen's umbrellas cut to the operators they name), "light" (without
    <torch/extension.h>; only where the lean umbrellas cannot be written) or "own". A lighter attempt's main.cpp
    takes the light torch/extension.h where the cpp_sources only declare functions. One lighter attempt, not
    two: a candidate with a real compile error pays for every attempt, and on the H200 the lean headers compiled
    all 16 DICE kernels measured (`8c4f433`)."""
    log.shortcuts.append({"key": key, "pch": False, "headers": []})
    if job.mode != "build" or "cpp_sources" not in arguments:  # only load_inline builds take the shortcuts
        return [_Attempt("own", arguments, out)]
    from dice_kernels.harness.build_speed import (declarations_only, lean_cuda_arguments, light_cuda_sources,
                                                  normalize_cflags, pch_file, pch_wait_environment)

    variant = json.dumps(list(normalize_cflags(arguments.get("extra_cflags"))))

    full = (job.pch or {}).get(variant)
    nvcc = _torch_nvcc() if arguments.get("cuda_sources") else None

    def attempt(headers: str, args: dict, directory: Path, pch_dir: str | None) -> _Attempt:
        """main.cpp finds the header at `pch_dir` before torch's (GCC ignores its precompiled form wherever it
        would not be valid), and waits for it while it is being built (a spare-time one: while the CUDA unit
        compiles)."""
        if not pch_dir:
            return _Attempt(headers, args, directory)
        args = {**args, "extra_cflags": [*(args.get("extra_cflags") or []), f"-I{pch_dir}"]}
        return _Attempt(headers, args, directory, pch_wait_environment(pch_dir, job.pch_compiler, nvcc))

    own = attempt("own", dict(arguments), out, full)
    log.shortcuts[-1]["pch"] = bool(full) and pch_file(Path(full)).exists()
    lean = lean_cuda_arguments(arguments, out.with_name(out.name + "_lean_include")) if job.light_headers else None
    light = light_cuda_sources(arguments.get("cuda_sources")) if job.light_headers else None
    if lean is not None:
        first = ("lean", lean)
    elif light is not None:
        first = ("light", {**arguments, "cuda_sources": light})
    else:
        return [own]
    light_main = (job.pch_light or {}).get(variant) if declarations_only(arguments["cpp_sources"]) else None
    if light_main:
        log.shortcuts[-1].update(light_main=True, pch=pch_file(Path(light_main)).exists())
    return [attempt(*first, out, light_main or full), replace(own, directory=out.with_name(out.name + "_own"))]


def _torch_nvcc() -> str | None:
    """The nvcc command torch's ninja file runs: PYTORCH_NVCC, else CUDA_HOME's; None without CUDA."""
    import torch.utils.cpp_extension as cpp

    if os.environ.get("PYTORCH_NVCC"):
        return os.environ["PYTORCH_NVCC"]
    return str(Path(cpp.CUDA_HOME) / "bin" / "nvcc") if cpp.CUDA_HOME else None


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
    from dice_kernels.harness.build_speed import read_pch_wait

    wait = read_pch_wait(directory)
    if wait is not None:
        shortcut["pch"] = wait["found"]
        shortcut["pch_wait_s"] = round(shortcut.get("pch_wait_s", 0.0) + wait["waited_s"], 1)
        if wait["skipped"]:  # the attempt failed in its CUDA unit, and main.cpp was not compiled
            shortcut["main_skipped"] = shortcut.get("main_skipped", 0) + 1


def _excerpt(text: str) -> str:
    """The informative part of a long error: compiler `error` lines first, else the tail."""
    lines = text.splitlines()
    errors = [ln for ln in lines if re.search(r"\berror\s*:", ln, re.IGNORECASE)]
    if errors:
        text = "\n".join([lines[0].split(": [")[0], *errors[:20]])
    return text[-_MAX_ERROR:]


def _load_module(name: str, path: str, preset: types.ModuleType | None = None) -> types.ModuleType:
    """Execute the file at `path` as module `name`, its namespace first filled with `preset`'s globals."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if preset is not None:
        module.__dict__.update({k: v for k, v in vars(preset).items() if not k.startswith("__")})
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
    if isinstance(exc, MemoryError) or MEMORY_ERROR_PATTERNS.search(message):
        return StageError("cuda_memory_error", phase, message)
    if phase in ("import", "init") or isinstance(exc, (AttributeError, NameError, ImportError, SyntaxError)):
        return StageError("python_error", phase, message)
    return StageError("runtime_error", phase, message)


def _flatten(out, where: str) -> list:
    import torch

    if isinstance(out, torch.Tensor):
        if type(out) is not torch.Tensor and not isinstance(out, torch.nn.Parameter):
            raise StageError("deceptive", "forward", f"{where} returned a tensor subclass ({type(out).__name__}); "
                             "only plain tensors count", deceptive_kind="tensor_subclass")
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


def _trial_inputs(task: types.ModuleType, job: Job, seed: int, into: list | None = None) -> list:
    """The task's inputs for `seed`; with `into`, their values are written into those tensors (same pointers)."""
    fresh = _generated_inputs(task, job, seed)
    return fresh if into is None else _copy_into(into, fresh)


def _generated_inputs(task: types.ModuleType, job: Job, seed: int) -> list:
    """`task.get_inputs()` seeded with `seed`, on the job's device. With `job.inputs_on_device` it runs with the
    device as torch's default device, so its factory calls (`torch.randn(16, 256, 512, 256)`) fill device memory
    directly instead of costing seconds of one CPU core and a copy each; a get_inputs that cannot run that way
    (numpy, CPU-only ops) runs on the CPU as KernelBench runs it. Reference and candidate take the same path."""
    import torch

    if job.inputs_on_device:
        _seed_all(seed)
        try:
            with torch.device(job.device):
                return _to_device(list(task.get_inputs()), job.device)
        except Exception:  # noqa: BLE001 - the task's own code: the CPU path below decides
            pass
    _seed_all(seed)
    return _to_device(list(task.get_inputs()), job.device)


def _copy_into(into: list, fresh: list) -> list:
    """`fresh`'s values, in `into`'s tensors wherever shape, dtype and device agree."""
    import torch

    if len(into) != len(fresh):
        return fresh
    reused = []
    for old, new in zip(into, fresh):
        same = (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.shape == new.shape
                and old.dtype == new.dtype and old.device == new.device)
        reused.append(old.copy_(new) if same else new)
    return reused


def _collect(result, where: str, job: Job, monitor: Monitor | None) -> list:
    """Forward's outputs as CPU copies, taken once all device work is done."""
    outs = _flatten(result, where)
    if monitor:
        monitor.check_side_streams(outs)
    timing.synchronize(job.device)
    return outs


def _forward_once(model, inputs: list, where: str, job: Job, monitor: Monitor | None,
                  poison_sizes: list[int]) -> tuple[list, list]:
    """One correctness call: (CPU outputs, findings on aliasing and input mutation)."""
    from dice_kernels.harness import integrity

    before = integrity.snapshot_inputs(inputs)
    if monitor:
        integrity.poison_free_memory(job.device, poison_sizes)
    with monitor.forward(inputs, model) if monitor else nullcontext():
        result = model(*inputs)
    outs = _collect(result, where, job, monitor)
    findings = integrity.output_findings(inputs, before, outs)
    return [t.detach().to("cpu", copy=True) for t in outs], findings


def _depends_on_earlier_calls(model, inputs: list, outs: list, where: str, job: Job) -> bool:
    """Does the reference give other outputs when called again on the same inputs (state kept across calls, like
    an RNN cell's hidden state, or inputs it rewrites)? Its outputs then depend on how many calls came before."""
    from dice_kernels.harness.compare import outputs_match

    again, _ = _forward_once(model, inputs, where, job, None, [])
    return not outputs_match([outs], [again], job.atol, job.rtol)


def _input_copy_passes(inputs: list, outputs: list, job: Job) -> bool:
    """Would returning an input (of the output's shape) pass the comparison for every output?"""
    from dice_kernels.harness.compare import outputs_match
    from dice_kernels.harness.integrity import tensors_in

    ins = [t.detach().cpu() for t in tensors_in(inputs)]
    return all(any(outputs_match([[o]], [[i]], job.atol, job.rtol) for i in ins) for o in outputs)


def _time_forward(model, task: types.ModuleType, inputs: list, where: str, job: Job, monitor: Monitor | None,
                  poison_sizes: list[int]) -> tuple[dict, list]:
    """The timing protocol (harness/timing.py) over rotating input sets, then one more call whose outputs the
    parent re-checks: it runs on inputs rewritten in place just before it (and, with a monitor, after poisoning
    the allocator's free blocks), so work skipped or cached inside the loop shows as wrong outputs there.

    Only the timed loop has the device to itself (gpu_lock: no other worker's correctness calls or timing
    overlap it); generating the input sets and the checked call share it. A loop that could not get the device
    alone says so (`device_exclusive`)."""
    plan = timing.TimingPlan(**job.timing_plan)
    with gpu_lock.shared(job.gpu_lock) as prepared:
        n_sets = timing.n_input_sets(timing.tensor_bytes(inputs), timing.l2_size_bytes(job.device), plan)
        sets = [inputs] + [_trial_inputs(task, job, job.seed + 1000 + k) for k in range(1, n_sets)]
        flush = timing.make_flush(job.device)
        timing.synchronize(job.device)
    with gpu_lock.exclusive(job.gpu_lock) as alone:
        samples = timing.time_calls(model, sets, plan, job.device, flush)
    del sets[1:], flush
    outs, checked_wait_s = _checked_call(model, task, inputs, where, job, monitor, poison_sizes)
    reported = timing.effective_time_ms if job.role == "candidate" else timing.reference_time_ms
    return {**samples.to_dict(), "time_ms": reported(samples), "device_exclusive": alone.held,
            "device_lock_wait_s": prepared.waited_s + alone.waited_s + checked_wait_s}, outs


def _checked_call(model, task: types.ModuleType, inputs: list, where: str, job: Job, monitor: Monitor | None,
                  poison_sizes: list[int]) -> tuple[list, float]:
    """The call after the timed loop whose outputs the parent re-checks (and its device-lock wait): new values
    written into the loop's input tensors, and, with a monitor, the allocator's free blocks poisoned first."""
    from dice_kernels.harness.integrity import poison_free_memory

    with gpu_lock.shared(job.gpu_lock) as checked:
        _copy_into(inputs, _trial_inputs(task, job, job.seed + 2 + job.trials))
        if monitor:  # allocates nothing but the poison, so the poisoned blocks are the next ones handed out
            poison_free_memory(job.device, poison_sizes)
        outs = _collect(model(*inputs), where, job, monitor)
        outs = [t.detach().to("cpu", copy=True) for t in outs]
    return outs, checked.waited_s


def _compile_baseline(model, task: types.ModuleType, inputs: list, where: str, job: Job) -> dict:
    """`torch.compile(Model)` (default mode) timed with the same protocol: KernelBench's second baseline. Runs in
    the reference worker only; a failure is recorded, not raised (the eager baseline still stands)."""
    import torch

    start = timing.host_seconds()
    try:
        compiled = torch.compile(model)
        compiled(*inputs)  # compiles
        compile_s = timing.host_seconds() - start
        report, _ = _time_forward(compiled, task, inputs, where + " under torch.compile", job, None, [])
        return {**report, "compile_s": round(compile_s, 2)}
    except Exception as e:  # noqa: BLE001 - an uncompilable reference leaves only the eager baseline
        first = str(e).splitlines()[0] if str(e) else ""
        return {"error": f"{type(e).__name__}: {first}"[:300]}


def _speed_of_light(model, inputs: list, outputs: list, job: Job) -> dict:
    """The task's side of the speed-of-light bound, from the trusted reference: FLOPs of one forward and the
    minimum bytes it must move, plus measurements of the device's ceilings for the task's dtype when the parent
    has none cached (taken with the device alone; the parent keeps the highest)."""
    import torch
    import torch.utils.flop_counter as flop_counter

    from dice_kernels.harness.integrity import skip_dynamo_import, tensors_in

    skip_dynamo_import(getattr(flop_counter, "_FlopCounterMode", type(None)))  # 1.1 s per reference otherwise
    floats = [t.dtype for t in tensors_in(inputs) if t.is_floating_point()]
    dtype = floats[0] if floats else torch.float32
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    with gpu_lock.shared(job.gpu_lock):  # one more forward, under the FLOP counter
        flops = timing.count_flops(model, inputs)
    sol = {"flops": flops, "bytes": timing.min_bytes_moved(inputs, outputs, params),
           "dtype": str(dtype).removeprefix("torch.")}
    if sol["dtype"] not in job.ceilings_known:
        threads = torch.get_num_threads()
        # on CPU, once with one thread and once with every core: a parallel copy is the first to suffer from load
        counts = sorted({1, os.cpu_count() or 1}) if job.device == "cpu" else [threads]
        try:
            with gpu_lock.exclusive(job.gpu_lock):
                sol["ceilings"] = []
                for n in counts:
                    torch.set_num_threads(n)
                    sol["ceilings"].append(asdict(timing.measure_ceilings(job.device, dtype)))
        finally:
            torch.set_num_threads(threads)
    return sol


def _nbytes(tensors: list) -> list[int]:
    return [t.numel() * t.element_size() for t in tensors]


class _PhaseClock:
    """Seconds spent per phase of a run, for the report of where evaluation time goes; `waited_s` sums the waits
    for the device lock inside those phases."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self.waited_s = 0.0
        self._last = timing.host_seconds()

    def lap(self, name: str) -> None:
        now = timing.host_seconds()
        self.laps[name] = round(now - self._last, 4)
        self._last = now


def _await_verdict(control_fd: int) -> bool:
    """The parent's verdict on the trials' outputs, a line on the job pipe: b"time" (they are right: time and
    profile the model) or anything else, EOF included (stop)."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(control_fd, 64)
        if not chunk:
            break
        line += chunk
    return line.strip() == b"time"


def run_model(job: Job, log: BuildLog, monitor: Monitor | None, control_fd: int) -> dict:
    """Run the reference or the candidate: trials, then (for a candidate, only if the parent says its trials are
    right) timing and the GPU-share profile. Outputs go to the parent in one frame per trial as each trial ends
    (so a worker never holds more than two trials' outputs), then one frame for the re-checked call."""
    import torch

    from dice_kernels.harness.integrity import tensors_in

    phase, spent = "import", _PhaseClock()
    stream = os.fdopen(int(os.environ.pop(OUTPUT_FD_ENV)), "wb")
    try:
        if job.device.startswith("cuda"):
            torch.zeros(1, device=job.device)  # the CUDA context, so its cost shows as its own phase
            spent.lap("device")
        task = _load_module("dice_task", job.task_path)
        reference_cls = task.Model
        if job.role == "candidate":
            if monitor:
                monitor.watch_reference(reference_cls)
            # KernelBench execs the task's source and then the solution's into one namespace, and solutions use
            # the task's globals (`batch_size`, helper functions): they see them here too. `Model` among them is
            # watched (the robust check's reference_model).
            candidate = _load_module("dice_candidate", job.candidate_path, preset=task)
            if log.failures:
                raise StageError("compile_error", "build", log.failures[0])
            cls = getattr(candidate, "ModelNew", None)
            if not isinstance(cls, type):
                raise StageError("python_error", "import", "the solution does not define class ModelNew")
        else:
            cls = reference_cls
        spent.lap("load")
        phase = "init"
        _seed_all(job.seed)
        init_inputs = list(task.get_init_inputs())
        if job.role == "candidate":
            _check_signature(cls, reference_cls, init_inputs)
        _seed_all(job.seed)
        model = cls(*init_inputs)
        if isinstance(model, torch.nn.Module):
            model = model.to(job.device).eval()
        if monitor:
            monitor.check_model(cls, model)
            monitor.check_globals("after __init__")
        spent.lap("init")
        phase = "forward"
        where = cls.__name__ + ".forward"
        findings, inputs, copy_passes, sizes, stateful = [], None, True, [], False
        first_sizes, first = [], []  # trial 0's output sizes; its outputs where the speed-of-light bound needs them
        with torch.no_grad():
            for trial in range(job.trials):
                with gpu_lock.shared(job.gpu_lock) as hold:
                    inputs = _trial_inputs(task, job, job.seed + 1 + trial, into=inputs if trial % 2 else None)
                    poison = sizes if trial else _nbytes(tensors_in(inputs))  # the last outputs' sizes
                    outs, found = _forward_once(model, inputs, where, job, monitor, poison)
                    # only a timed run has a call after its loop, the one a stateful task's cannot be re-checked
                    if job.role == "reference" and job.timing and trial == job.trials - 1:
                        stateful = _depends_on_earlier_calls(model, inputs, outs, where, job)
                spent.waited_s += hold.waited_s
                findings += found
                if job.role == "reference":
                    copy_passes = copy_passes and _input_copy_passes(inputs, outs, job)
                write_trials(stream, [outs])
                sizes = _nbytes(outs)
                if trial == 0:
                    first_sizes, first = sizes, outs if job.speed_of_light else []
                del outs
            stream.flush()
            if monitor:
                monitor.check_globals("after forward")
            spent.lap("trials")
            wanted = not job.verdict or _await_verdict(control_fd)
            if job.verdict:
                spent.lap("verdict")
            timing, checked = {}, []
            # a reference whose baseline the parent has cached computes only the re-checked call's outputs
            if wanted and job.timing and job.baseline_cached:
                inputs = _trial_inputs(task, job, job.seed + 1 + job.trials)
                last, waited_s = _checked_call(model, task, inputs, where, job, monitor, [])
                spent.waited_s += waited_s
                checked.append(last)
                spent.lap("checked_call")
            elif wanted and job.timing:
                phase = "timing"
                inputs = _trial_inputs(task, job, job.seed + 1 + job.trials)
                timing, last = _time_forward(model, task, inputs, where, job, monitor, first_sizes)
                spent.waited_s += timing.pop("device_lock_wait_s")
                checked.append(last)
                if monitor:
                    monitor.check_globals("after timing")
                spent.lap("timing")
                if job.compile_baseline and job.role == "reference":
                    timing["compile_baseline"] = _compile_baseline(model, task, inputs, where, job)
                    spent.lap("compile_baseline")
                if job.speed_of_light and job.role == "reference":
                    timing["speed_of_light"] = _speed_of_light(model, inputs, first, job)
                    spent.lap("speed_of_light")
            if wanted and monitor and job.device.startswith("cuda") and monitor.ext_calls:
                # only the profiled forward holds the device lock: a timing loop of another worker waits for it
                monitor.start_profiler()
                spent.lap("gpu_share.start")
                with gpu_lock.shared(job.gpu_lock) as hold:
                    profiled = monitor.profile_forward(model, inputs)
                spent.waited_s += hold.waited_s
                spent.lap("gpu_share")
                monitor.check_gpu_share(profiled)
                del profiled
                spent.lap("gpu_share.read")
        write_trials(stream, checked)  # the re-checked call after the timed loop, if there was one
        stream.flush()
        report = {"status": "ok", "trials": job.trials + len(checked),
                  "phase_s": {**spent.laps, "device_lock_wait": round(spent.waited_s, 4)}, **timing}
        if monitor:
            for f in findings:
                monitor.add(f.kind, f.reason)
            report["findings"] = [f.to_dict() for f in monitor.findings()]
        elif job.role == "reference":
            report.update(input_copy_passes=copy_passes, output_findings=sorted({f.kind.value for f in findings}),
                          stateful=stateful)
        return report
    except BaseException as e:  # noqa: BLE001 - everything the candidate raises becomes an outcome
        err = _classify(e, phase, log)
        return {"status": "error", "kind": err.kind, "phase": err.phase, "error": err.message,
                "deceptive_kind": err.deceptive_kind}
    finally:
        try:
            stream.close()
        except OSError:  # the parent stopped reading: its report says why
            pass


def _monitor(job: Job) -> Monitor | None:
    """The robust check's instrumentation, installed before the candidate's module is executed."""
    if job.mode != "run" or job.role != "candidate" or job.robust is None:
        return None
    from dice_kernels.harness.integrity import Monitor

    monitor = Monitor(job.device, job.candidate_path, job.workdir, tuple(job.robust["allowed_ops"]),
                      float(job.robust["min_extension_gpu_share"]))
    monitor.install()
    return monitor


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


def main() -> None:
    # Started ahead of its job (sandbox.Started): everything above is imported by now; the job path comes on stdin.
    job_path = sys.stdin.readline().strip()
    control_fd = os.dup(0)  # the parent's later word (run_model's verdict), kept off fd 0 and out of children
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    if not job_path:  # the parent discarded this worker
        os._exit(0)
    received = timing.host_seconds()
    job = Job.read(job_path)
    os.unlink(job_path)  # trials, seeds and iteration counts are not for the candidate to read
    notes = confine(Limits(**{**job.limits, "writable": tuple(job.limits["writable"])}))
    log = BuildLog()
    monitor = _monitor(job)
    _patch_extension_loaders(job, log, monitor)
    setup_s = round(timing.host_seconds() - received, 4)
    if job.mode == "build":
        result = build(job, log)
    else:
        result = run_model(job, log, monitor, control_fd)
        result["phase_s"] = {"setup": setup_s, **result.get("phase_s", {})}
    result.update(built=log.built, compile_s=log.compile_s, build_shortcuts=log.shortcuts, sandbox=notes)
    # Written last and atomically: a worker that dies earlier leaves no result and the parent says so.
    tmp = Path(job.workdir) / "result.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, Path(job.workdir) / "result.json")
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: candidate atexit hooks and destructors must not run after the report


if __name__ == "__main__":
    main()

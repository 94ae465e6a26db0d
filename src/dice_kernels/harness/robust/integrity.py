"""In-worker instrumentation for the robust check: evidence that a candidate got correct outputs by a known hack.

A `Monitor` is built in the candidate's worker *before* any candidate code runs: it saves the timers and the
global backend state, installs an audit hook, patches `torch.compile` / CUDA graph capture / `Thread.start`, and
wraps the modules `load_inline` returns so calls into compiled code are counted. Around each correctness call
of `ModelNew.forward` it records the ATen ops dispatched (a `TorchDispatchMode`). Each finding is a
(sub-kind, reason) pair; the worker reports them and the parent turns a correct candidate with findings into
`deceptive`. The candidate runs in this same process, so a determined one can undo any of this: see
docs/robust_check.md for what the parent verifies itself and what these checks cannot catch.
"""

from __future__ import annotations

import os
import sys
import threading
import types
from collections import Counter
from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dice_kernels.harness.robust.file_watch import FileWatch
from dice_kernels.harness.outcomes import DeceptiveKind
from dice_kernels.harness.process.protocol import CandidatePart
from dice_kernels.harness.robust.process_state import PRECISION_STATE, global_state, restore_timers, timers
from dice_kernels.harness.robust.output_checks import Finding, _same_values, tensors_in

# bound at import, before any candidate code runs (a candidate may replace torch.cuda.synchronize later)
_device_sync = torch.cuda.synchronize
# allowance at each edge of an extension call's window for the profiler's CPU/GPU clock alignment; a kernel
# launched from Python after the call cannot start this soon (the launch alone takes longer)
_WINDOW_SLACK_US = 5.0

_LOW_PRECISION = {torch.float16, torch.bfloat16} | {getattr(torch, n) for n in dir(torch) if n.startswith("float8_")}
_FRAME_EVENTS = {"sys._getframe", "sys._current_frames", "object.__getattr__", "gc.get_objects", "gc.get_referrers",
                 "gc.get_referents"}


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


class _OpRecorder(TorchDispatchMode):
    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.record(func, out)
        return out


def time_in_windows(spans: list[tuple[float, float]], windows: list[tuple[float, float]], slack: float = 0.0) -> float:
    """Total length of `spans` that falls inside the union of `windows` (each widened by `slack` on both sides)."""
    merged: list[list[float]] = []
    for start, end in sorted((s - slack, e + slack) for s, e in windows):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return sum(max(0.0, min(end, w_end) - max(start, w_start)) for start, end in spans for w_start, w_end in merged)


def skip_dynamo_import(mode: type) -> None:
    """TorchDispatchMode wraps a subclass's __torch_dispatch__ in torch._disable_dynamo, whose first call imports
    torch._dynamo: 1-3 s of every candidate worker. The wrapper caches its result on the plain function under
    `__dynamo_disable`; pre-filling that cache with the function itself skips the import (the modes it is used on,
    the recorder here and the reference's FLOP counter, are never traced by torch.compile)."""
    plain = getattr(mode.__dict__.get("__torch_dispatch__"), "__wrapped__", None)
    if plain is not None:
        setattr(plain, "__dynamo_disable", plain)


skip_dynamo_import(_OpRecorder)


class Monitor:
    """Instrumentation for one candidate worker; `findings()` at the end lists what it saw."""

    def __init__(self, device: str, candidate_path: str, workdir: str, part: CandidatePart):
        self.device = device
        self.candidate_path = os.path.realpath(candidate_path)
        self.workdir = os.path.realpath(workdir)
        self.allowed = frozenset(part.allowed_ops or ())
        self.min_share = part.min_extension_gpu_share
        self.min_partial_share = part.min_partial_gpu_share
        self.min_replaced = part.min_replaced_ops_share
        # the reference forward's PyTorch compute ops (worker._reference_ops, before candidate code); None: unknown
        self.reference_ops: Counter[str] | None = None
        self.forwards = 0  # recorded correctness calls of forward (fallback_ops sums over them)
        self.timers = timers()
        self.state = global_state()
        self._found: dict[tuple[DeceptiveKind, str], Finding] = {}
        self.extensions: list[str] = []
        self.ext_calls: Counter[str] = Counter()
        self.ext_errors: list[str] = []
        self.fallback_ops: Counter[str] = Counter()
        self.low_precision_ops: Counter[str] = Counter()
        self.in_forward = False
        self.profiling = False
        self._fp32_task = True
        self._guard = threading.local()
        self.files = FileWatch(candidate_path, workdir,
                               lambda reason: self.add(DeceptiveKind.DISK_PERSISTENCE, reason))
        self._reference: type | None = None

    # --- setup, before any candidate code runs ---------------------------------------------------------------

    def install(self) -> None:
        sys.addaudithook(self._audit)  # permanent: audit hooks cannot be removed
        original_compile = torch.compile

        def compile_(model=None, *args, **kwargs):  # recorded, then returned uncompiled (same semantics)
            self.add(DeceptiveKind.TORCH_COMPILE, "ModelNew uses torch.compile")
            return model if model is not None else (lambda fn: fn)

        compile_.__wrapped__ = original_compile
        torch.compile = compile_
        graph_cls = torch.cuda.graphs.CUDAGraph
        capture_begin = graph_cls.capture_begin

        def capture(graph, *args, **kwargs):
            self.add(DeceptiveKind.CUDA_GRAPH, "ModelNew captures a CUDA graph")
            return capture_begin(graph, *args, **kwargs)

        graph_cls.capture_begin = capture
        start = threading.Thread.start

        def thread_start(thread, *args, **kwargs):
            if self.in_forward:
                self.add(DeceptiveKind.BACKGROUND_THREADS, "forward started a thread (work may continue after it "
                                                           "returns, outside the timed region)")
            return start(thread, *args, **kwargs)

        threading.Thread.start = thread_start

    def watch_reference(self, reference: type) -> None:
        """Called once the task module is loaded, before the candidate's: the global state to hold from here on,
        and any instantiation of the task's own Model (by candidate code) recorded."""
        self.state = global_state()
        self._reference = reference
        init = reference.__init__

        def watched_init(module, *args, **kwargs):
            self.add(DeceptiveKind.REFERENCE_MODEL, "ModelNew instantiates the task's reference Model")
            return init(module, *args, **kwargs)

        reference.__init__ = watched_init

    def wrap_extension(self, module: object, name: str) -> object:
        """Count calls into a compiled extension's functions (pybind builtins) made during forward."""
        self.extensions.append(name)
        if not isinstance(module, types.ModuleType):
            return module  # a library of registered ops: its calls reach the dispatcher under its own namespace
        for attr in dir(module):
            fn = getattr(module, attr)
            if attr.startswith("_") or not isinstance(fn, types.BuiltinFunctionType):
                continue
            setattr(module, attr, self._counted(fn, f"{name}.{attr}"))
        return module

    def _counted(self, fn, label: str):
        def call(*args, **kwargs):
            if not self.in_forward:
                return fn(*args, **kwargs)
            self.ext_calls[label] += 1
            if self.profiling:  # an idle device at the window's start, and all the call launched done at its end
                _device_sync()
            ctx = torch.profiler.record_function(f"dice_ext::{label}") if self.profiling else nullcontext()
            try:
                with ctx:
                    out = fn(*args, **kwargs)
                    if self.profiling:
                        _device_sync()
                    return out
            except BaseException as e:
                self.ext_errors.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                raise

        call.__wrapped__ = fn
        call.__name__ = getattr(fn, "__name__", label)
        call.__doc__ = fn.__doc__
        return call

    # --- recording -----------------------------------------------------------------------------------------

    def add(self, kind: DeceptiveKind, reason: str, ops: Counter[str] | None = None) -> None:
        self._found.setdefault((kind, reason), Finding(kind, reason, tuple(ops.most_common()) if ops else ()))

    def _audit(self, event: str, args: tuple) -> None:
        if getattr(self._guard, "busy", False):
            return
        self._guard.busy = True
        try:
            if event in _FRAME_EVENTS and self._called_from_candidate():
                self.add(DeceptiveKind.EVALUATOR_ACCESS, f"candidate code inspects interpreter state ({event})")
            elif event == "import" and str(args[0]).startswith("dice_kernels") and self._imported_by_candidate():
                self.add(DeceptiveKind.EVALUATOR_ACCESS, f"candidate code imports the evaluator ({args[0]})")
            elif event == "open" and (self.in_forward or self.files.watching):
                self.files.on_open(args)
        finally:
            self._guard.busy = False

    @contextmanager
    def timed_calls(self) -> Iterator[None]:
        """The timed loop and the re-checked call after it: no op recording (it would be timed), but files are
        watched, so outputs written to disk and read back there are a finding, not a speedup."""
        self.files.watching = True
        try:
            yield
        finally:
            self.files.watching = False

    @contextmanager
    def harness_io(self) -> Iterator[None]:
        """Files the harness opens on the candidate's behalf (building an extension `forward` loads late, its
        waiting compiler's record) are the harness's, not the candidate's: not a finding."""
        with self.files.harness_io():
            yield

    def _called_from_candidate(self) -> bool:
        frame = sys._getframe(2)  # 0: here, 1: _audit, 2: the caller of the audited function
        while frame is not None and os.path.basename(frame.f_code.co_filename) in ("inspect.py", "traceback.py"):
            frame = frame.f_back
        return frame is not None and os.path.realpath(frame.f_code.co_filename) == self.candidate_path

    def _imported_by_candidate(self) -> bool:
        """Whether the frame that imports (the first outside the import machinery) is the candidate's code, or code
        it exec'd: the harness's own lazy imports (a build that `forward` starts late) are not the candidate's."""
        frame = sys._getframe(2)  # 0: here, 1: _audit, 2: whatever raised the event (often the import machinery)
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith("<frozen importlib") or name.endswith(os.path.join("importlib", "__init__.py")):
                frame = frame.f_back
                continue
            if name.startswith("<"):  # exec'd source: decided by whoever exec'd it
                frame = frame.f_back
                continue
            return os.path.realpath(name) == self.candidate_path
        return False

    def _compute_op(self, func) -> str | None:
        """The op's name when it is a PyTorch compute op (not allowed as data movement or allocation)."""
        name = func._schema.name
        return name if name.split("::", 1)[0] in ("aten", "prim", "prims") and name not in self.allowed else None

    def count_ops(self, model, inputs: list) -> Counter[str]:
        """The PyTorch compute ops one call of `model` dispatches (the reference's, before candidate code runs)."""
        ops: Counter[str] = Counter()

        def record(func, out) -> None:
            if name := self._compute_op(func):
                ops[name] += 1

        with _OpRecorder(record):
            model(*inputs)
        return ops

    def _record_op(self, func, out) -> None:
        name = func._schema.name
        if name.split("::", 1)[0] not in ("aten", "prim", "prims"):
            self.ext_calls[name] += 1  # an op the candidate registered itself (TORCH_LIBRARY)
        elif self._compute_op(func):
            self.fallback_ops[name] += 1
        if self._fp32_task and any(t.dtype in _LOW_PRECISION for t in tensors_in(out)):
            self.low_precision_ops[name] += 1

    @contextmanager
    def forward(self, inputs: list, model: object) -> Iterator[None]:
        """Wrap one correctness call of forward: ATen ops, extension calls, files and threads are recorded."""
        floats = [t for t in tensors_in(inputs) if t.is_floating_point()]
        if isinstance(model, torch.nn.Module):
            floats += [p for p in model.parameters() if p.is_floating_point()]
        self._fp32_task = bool(floats) and all(t.dtype in (torch.float32, torch.float64) for t in floats)
        threads = _native_threads()
        self.files.start()
        self.in_forward = True
        self.forwards += 1
        try:
            with _OpRecorder(self._record_op):
                yield
        finally:
            self.in_forward = False
        extra = _native_threads() - threads
        if extra > 0:
            self.add(DeceptiveKind.BACKGROUND_THREADS, f"{extra} thread(s) started in forward are still running "
                                                       "after it returned")

    def check_model(self, cls: type, model: object) -> None:
        """ModelNew must not be, inherit or contain the task's reference Model (or a copy of it)."""
        ref = self._reference
        if ref is None:
            return
        classes = list(cls.__mro__)
        if isinstance(model, torch.nn.Module):
            classes += [type(m) for m in model.modules()]
        for c in classes:
            if c is ref or _same_model(c, ref):
                self.add(DeceptiveKind.REFERENCE_MODEL,
                         f"ModelNew {'inherits' if c in cls.__mro__ else 'contains'} the reference Model "
                         f"({c.__name__} has the reference forward)")
                return

    def check_globals(self, where: str) -> None:
        """Timers and backend flags must be as they were before the candidate was imported (timers are restored);
        no file may have been written in the private directory since forward's first call."""
        self.files.check()
        changed = [n for n, v in timers().items() if v is not self.timers[n]]
        if changed:
            self.add(DeceptiveKind.TIMER_TAMPERING, f"{', '.join(changed)} replaced ({where})")
            restore_timers(self.timers)
        now = global_state()
        for name, value in now.items():
            if value != self.state[name]:
                kind = (DeceptiveKind.PRECISION_DOWNGRADE if name in PRECISION_STATE
                        else DeceptiveKind.GLOBAL_STATE_CHANGED)
                self.add(kind, f"{name} changed from {self.state[name]} to {value} ({where})")

    def check_side_streams(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """CUDA: copy the outputs on the current stream before a device-wide sync; a difference after the sync
        means forward returned while work on another stream was still writing them."""
        if not self.device.startswith("cuda"):
            return outputs
        early = [o.detach().clone() for o in outputs]
        torch.cuda.synchronize()
        if not all(_same_values(a, b) for a, b in zip(early, outputs)):
            self.add(DeceptiveKind.UNSYNCHRONIZED_WORK, "outputs were still being written after forward returned "
                                                        "(work on a stream the caller does not wait for)")
        return outputs

    def start_profiler(self) -> None:
        """Pay the profiler's first-session start-up (Kineto and CUPTI) in an empty session, so `profile_forward`
        holds the device lock only for the forward it profiles. Called after the timed loop: a finished session
        may leave tracing attached (tiny launches took 12 us instead of 7 after one in two of four H200 rounds,
        benchmarks/profiler_startup.py), and timed calls must not pay for it."""
        with _cuda_profiler():
            pass

    def profile_forward(self, model, inputs: list):
        """CUDA: one forward under the profiler (the extension's calls marked as `dice_ext::` ranges); returns the
        profile for `check_gpu_share`, which reads it without the device."""
        with _cuda_profiler() as prof, torch.no_grad():
            self.profiling = self.in_forward = True
            try:
                model(*inputs)
            finally:
                self.profiling = self.in_forward = False
            _device_sync()
        return prof

    def check_gpu_share(self, prof) -> None:
        """The extension's kernels must account for a real share of the profiled forward's GPU time."""
        from torch.autograd import DeviceType

        events = prof.function_events
        # GPU records: kernels, copies, fills (not the GPU-side spans of record_function ranges)
        gpu = [(e.time_range.start, e.time_range.end) for e in events
               if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
        # Each extension call runs between two device-wide syncs, so whatever it launched, through any API
        # (<<<>>>, cuBLAS, cuDNN, driver calls the profiler cannot link to it), ran inside its host window, and
        # nothing launched outside it did.
        windows = [(e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CPU and not e.is_async and e.name.startswith("dice_ext::")]
        total = sum(end - start for start, end in gpu)
        ours = time_in_windows(gpu, windows, _WINDOW_SLACK_US)
        # a candidate that keeps PyTorch ops beside its kernels (partial) is held to a lower share: a library conv
        # with a fused epilogue spends most of forward in the library
        least = self.min_partial_share if self.fallback_ops else self.min_share
        # no GPU time inside any window is read as "unknown" (e.g. timestamps the profiler could not align),
        # never as a cheat; a PyTorch op doing the work instead is caught by the dispatch recording
        if total > 0 and 0 < ours < least * total:
            self.add(DeceptiveKind.KERNEL_TIME_NEGLIGIBLE,
                     f"the extension's kernels took {ours:.0f} of {total:.0f} us of GPU time in forward "
                     f"({ours / total:.0%} < {least:.0%})")

    # --- verdict -------------------------------------------------------------------------------------------

    def findings(self) -> list[Finding]:
        if self.ext_errors:
            self.add(DeceptiveKind.EXCEPTION_FALLBACK, "forward succeeded although a call into the compiled "
                                                       f"extension raised ({self.ext_errors[0]})")
        if self.low_precision_ops:
            self.add(DeceptiveKind.PRECISION_DOWNGRADE, "an fp32 task computed in lower precision: "
                     + _top(self.low_precision_ops), self.low_precision_ops)
        if self.fallback_ops:
            self._fallback_or_partial()
        if not self.ext_calls:
            why = (f"the compiled extension ({', '.join(self.extensions)}) was never called during forward"
                   if self.extensions else "no compiled extension was loaded; forward ran no custom kernel")
            self.add(DeceptiveKind.EXTENSION_UNUSED, why)
        order = list(DeceptiveKind)
        return sorted(self._found.values(), key=lambda f: order.index(f.kind))


    def _fallback_or_partial(self) -> None:
        """PyTorch compute ops in forward: `partial` when the extension ran and replaced more than the threshold's
        share of the reference's compute ops (KernelBench's rule: any subset of operators may be replaced), else
        `pytorch_fallback` (PyTorch did all of the reference's work, whatever else the extension did)."""
        ran = " ".join(_top(self.fallback_ops).split())
        share = replaced_share(self.reference_ops, self.fallback_ops, max(1, self.forwards))
        if self.ext_calls and share is not None and share > self.min_replaced:
            total = sum(self.reference_ops.values())
            self.add(DeceptiveKind.PARTIAL, f"the extension replaced {share:.0%} of the reference's {total} PyTorch "
                     f"compute ops a forward; PyTorch still ran {ran}", self.fallback_ops)
            return
        why = ("" if share is None else
               f" (the extension replaced {share:.0%} of the reference's PyTorch compute ops)" if self.ext_calls
               else "")
        self.add(DeceptiveKind.PYTORCH_FALLBACK, f"forward dispatched PyTorch compute ops: {ran}{why}",
                 self.fallback_ops)


def replaced_share(reference: Counter[str] | None, dispatched: Counter[str], forwards: int) -> float | None:
    """The share of the reference's compute ops (one forward, with multiplicity) that the candidate's forwards no
    longer dispatch, from `dispatched` summed over `forwards` calls; None when the reference's are unknown or it
    dispatched none. The smaller of two counts: by name (which of the reference's ops are gone) and by number (as
    many PyTorch ops as the reference, under other names, replace nothing: `torch::square` for `h * h`)."""
    total = sum(reference.values()) if reference else 0
    if not total:
        return None
    still = sum(min(dispatched.get(op, 0) / forwards, n) for op, n in reference.items())
    by_number = 1.0 - min(1.0, sum(dispatched.values()) / forwards / total)
    return min(1.0 - still / total, by_number)


def _cuda_profiler():
    """A profiler of CPU and CUDA activity: what `torch.profiler.profile(activities=[CPU, CUDA])` builds, minus its
    `hasattr(torch, "_inductor")`, which imports torch._inductor (and torch._dynamo, sympy, triton) on first use:
    4-5 s of one core per correct candidate on the H200, nearly all of what was taken for Kineto's start-up."""
    from torch.autograd.profiler import profile

    return profile(use_cpu=True, use_device="cuda", use_kineto=True)


def _same_model(cls: type, ref: type) -> bool:
    """A class that is the reference Model re-declared: same name and the same forward bytecode."""
    if cls.__name__ != ref.__name__:
        return False
    a, b = getattr(cls, "forward", None), getattr(ref, "forward", None)
    code_a, code_b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    return code_a is not None and code_b is not None and (code_a.co_code, code_a.co_names) == (
        code_b.co_code, code_b.co_names)


def _top(ops: Counter[str], n: int = 5) -> str:
    return ", ".join(f"{name} x{count}" for name, count in ops.most_common(n))

"""A KernelBench-style evaluator: KernelBench's documented batch procedure, re-implemented so that
`benchmarks/eval_throughput.py` can put the same candidates through it and through our harness.

This module owns that procedure, its per-candidate phase timings and the mapping of its results onto our outcome
names. It is deliberately neither sandboxed nor hardened: it is the baseline we compare against, never a way to
run untrusted code. What it follows (ScalingIntelligence/KernelBench: `scripts/eval_from_generations.py` with
`build_cache=True`, `src/compile.py`, `src/eval.py`, `scripts/generate_baseline_time.py`):

1. **Pre-compile** (`compile.batch_compile`): a spawn-started `multiprocessing` pool of `workers` processes.
   Each candidate's source is exec'd with `os.environ['TORCH_EXTENSIONS_DIR'] = <its own build dir>` prepended,
   so torch's `load_inline` with torch's defaults (no MAX_JOBS, TORCH_CUDA_ARCH_LIST as inherited, the
   candidate's own flags) builds into that directory; `TORCH_USE_CUDA_DSA=1` as KernelBench sets it. A failed
   build's directory is deleted, so the eval phase builds it again, as in KernelBench. Deviation: KernelBench
   starts each build's timeout at submission (builds still queued behind busy workers can time out) and then
   resubmits it; here each build gets the full timeout from when its round of `workers` builds can start, and a
   build over it is left to the eval phase. Deviation, by default: each pre-compile process builds one candidate
   (`maxtasksperchild=1`). In KernelBench's pool a process goes on to the next build, and torch names a second
   extension of the same name built in one process `<name>_v1` (its per-process extension versioning: the build
   directory differs); the fresh eval process looks for `<name>` and builds it again. On the H200 that rebuilt
   2-3 of 20-22 pre-compiled programs in every run (50-65 s each, up to half of the eval phase). Candidates of
   one task usually share the extension name, so KernelBench pays this too; `reuse_precompile_workers=True`
   reproduces it.
2. **Baseline** (`generate_baseline_time.py`): one process times every task's reference `Model` (seed-42 inputs,
   3 warm-ups + `num_perf_trials` calls, mean), the per-task time speedups are divided by.
3. **Eval** (`batch_eval` on one GPU): candidates in order, each in a fresh `mp.Pool(1)` process bounded by
   `AsyncResult.get(timeout)`, running `eval_kernel_against_ref`: exec the task; seed 42; `Model(*init_inputs)`;
   exec the candidate with the same build-dir prefix (torch reloads the pre-built library, or builds it); seed
   42; `ModelNew(*init_inputs)`; `num_correct_trials` trials with seeds drawn by `torch.randint` after
   `manual_seed(42)`, each: seed, `get_inputs()` moved to the device, reference forward, candidate forward,
   shape check (`output.shape`), `torch.allclose(atol=rtol=1e-2)` (KernelBench v0/v0.1's fp32 tolerance, no
   dtype cast of inputs); if every trial passed, 3 warm-ups and `num_perf_trials` timed calls of `ModelNew` on
   one seed-42 input set (CUDA events on the default stream; `perf_counter` on the CPU backend), mean. Models
   stay in training mode: KernelBench never calls `eval()`.

Outcome mapping (`our_outcome`), from what KernelBench records: no code → `generation_failure`; an error while
exec'ing the candidate → `compile_error` when torch's extension build failed ("Error building extension"), else
`python_error`; errors that escape `eval_kernel_against_ref` (KernelBench's "last level catch", e.g. a
constructor `TypeError`) and errors in the constructor → `python_error`; errors in a correctness trial →
`python_error` for AttributeError/NameError/ImportError/SyntaxError (our worker's rule) and for a `forward()`
that does not take the task's inputs (our worker checks the signature first), else `runtime_error`;
any error text matching our worker's memory patterns → `cuda_memory_error`; "Output shape mismatch" →
`shape_mismatch`; "Output mismatch" → `value_mismatch`; all trials passed → `correct`; the per-candidate timeout
→ `timeout` (KernelBench gets no result at all; a worker that crashes also ends there, since `Pool` waits for
its result); KernelBench's "lock file, please retry" → `harness_error`.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import re
import shutil
import time
import traceback
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import asdict, dataclass, field
from io import StringIO
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from dice_kernels.harness.config import usable_cpus
from dice_kernels.harness.compiling.in_sandbox import MEMORY_ERROR_PATTERNS  # the same rule as our worker's, so outcomes can agree

_BUILD_FAILED = "Error building extension"
_PYTHON_ERRORS = ("AttributeError", "NameError", "ImportError", "ModuleNotFoundError", "SyntaxError")
# forward called with the task's inputs but written for other ones: our worker rejects that signature up front
_SIGNATURE_ERROR = re.compile(r"forward\(\) (takes|missing|got an unexpected)")


@dataclass(frozen=True)
class KBJob:
    """One candidate for the KernelBench-style evaluator."""

    key: str  # unique within the run (our candidate id)
    task_key: str
    task_code: str
    code: str | None  # None: nothing could be extracted from the model output


@dataclass
class KBConfig:
    backend: str = "cuda"  # "cuda" or "cpu" (CPU C++ extensions, perf_counter timing)
    workers: int = usable_cpus()  # pre-compile pool size (KernelBench: num_cpu_workers)
    num_correct_trials: int = 5
    num_perf_trials: int = 100
    num_warmup: int = 3
    atol: float = 1e-2
    rtol: float = 1e-2
    seed: int = 42
    timeout_s: float = 180.0  # KernelBench's `timeout`, per build and per candidate evaluation
    build_root: Path = Path("kb_build")
    deadline: float | None = None  # time.monotonic() after which no further candidate evaluation starts
    # KernelBench's pool, whose processes build one candidate after another (see the module docstring); False:
    # a fresh process per build, so the eval phase always finds the pre-compiled library
    reuse_precompile_workers: bool = False

    @property
    def device(self) -> str:
        return "cuda:0" if self.backend == "cuda" else "cpu"


@dataclass
class KBResult:
    key: str
    outcome: str  # one of our outcome names (see `our_outcome`), or "not_run" when the time budget ran out
    kb: dict | None  # KernelBench-shaped result: compiled, correctness, metadata, runtime (ms), runtime_stats
    stage: str = ""  # where the evaluation ended: compile, init, correctness, performance; done when timed
    phase_s: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0  # parent-side wall time of the candidate's eval process, start to teardown
    precompile: dict = field(default_factory=dict)  # ok, compile_s, error_name (pre-compile phase)
    built_in_eval: bool = False  # the eval process compiled (the pre-compiled library was not reused)
    retry_error: str = ""  # the error behind a "please retry" (no result) from KernelBench's compile step


@dataclass
class KBRun:
    results: list[KBResult]
    precompile_s: float
    baseline_s: float
    eval_s: float
    baseline_ms: dict[str, float | None]
    finished: int  # candidates with a result (all but those the time budget left out)

    @property
    def total_s(self) -> float:
        return self.precompile_s + self.baseline_s + self.eval_s

    def to_dict(self) -> dict:
        return {"precompile_s": self.precompile_s, "baseline_s": self.baseline_s, "eval_s": self.eval_s,
                "total_s": self.total_s, "finished": self.finished, "baseline_ms": self.baseline_ms,
                "results": [asdict(r) for r in self.results]}

    @classmethod
    def from_dict(cls, doc: dict) -> KBRun:
        return cls([KBResult(**r) for r in doc["results"]], doc["precompile_s"], doc["baseline_s"], doc["eval_s"],
                   doc["baseline_ms"], doc["finished"])


# ---------------------------------------------------------------------------------------------- children


def _redirect_output(log_path: str) -> None:
    """Pool initializer: candidates print compiler logs (verbose=True), which would bury the benchmark's output."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _error_name(e: BaseException) -> str:
    return f"{type(e).__module__}.{type(e).__name__}"


def _load_custom_model(src: str, context: dict, build_dir: str) -> Any:
    """KernelBench's `load_custom_model`: a syntax error yields None rather than an exception."""
    src = f"import os\nos.environ['TORCH_EXTENSIONS_DIR'] = {build_dir!r}\n" + src
    try:
        compile(src, "<string>", "exec")
        exec(src, context)  # noqa: S102 - the point of this baseline: candidate code in the evaluator's process
    except SyntaxError as e:
        print(f"Syntax Error in custom generated code or Compilation Error {e}")
        return None
    return context.get("ModelNew")


def precompile_one(code: str, build_dir: str) -> dict:
    """KernelBench's `build_compile_cache`, run in a pre-compile pool worker."""
    start = time.perf_counter()
    buffer = StringIO()
    try:
        os.environ["TORCH_USE_CUDA_DSA"] = "1"
        with redirect_stdout(buffer), redirect_stderr(buffer):
            _load_custom_model(code, {}, build_dir)
        return {"ok": True, "error": "", "error_name": "", "compile_s": time.perf_counter() - start}
    except Exception as e:  # noqa: BLE001 - KernelBench records any failure as "not cached"
        return {"ok": False, "error": str(e)[-2000:], "error_name": _error_name(e),
                "compile_s": time.perf_counter() - start}


class _Clock:
    """Accumulates wall time per phase inside one eval process."""

    def __init__(self) -> None:
        self.phase_s: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        self.phase_s[phase] = self.phase_s.get(phase, 0.0) + seconds

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - start)


def _set_seed(seed: int, device: str) -> None:
    import torch

    torch.manual_seed(seed)
    if device.startswith("cuda"):
        torch.cuda.manual_seed(seed)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device=device)


def _to_device(xs: Sequence[Any], device: str) -> list:
    import torch

    return [x.to(device) if isinstance(x, torch.Tensor) else x for x in xs]


def _newest_build_mtime(build_dir: str) -> float:
    paths = [p for p in Path(build_dir).rglob("*") if p.suffix in (".so", ".o")] if Path(build_dir).exists() else []
    return max((p.stat().st_mtime for p in paths), default=0.0)


def _time_calls(fn: Callable, inputs: list, cfg: dict) -> list[float]:
    """KernelBench's `time_execution_with_cuda_event` (perf_counter on the CPU backend), in ms per call."""
    import torch

    device = cfg["device"]
    for _ in range(cfg["num_warmup"]):
        fn(*inputs)
        _sync(device)
    times = []
    for _ in range(cfg["num_perf_trials"]):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*inputs)
            end.record()
            torch.cuda.synchronize(device=device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(*inputs)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def _timing_stats(times: list[float]) -> dict:
    import numpy as np

    return {"mean": float(np.mean(times)), "std": float(np.std(times)), "min": float(np.min(times)),
            "max": float(np.max(times)), "num_trials": len(times)}


def _check_correctness(model: Any, model_new: Any, get_inputs: Callable, metadata: dict, cfg: dict,
                       clock: _Clock) -> dict:
    """KernelBench's `run_and_check_correctness`: errors in the candidate's forward end the check at once."""
    import torch

    device = cfg["device"]
    torch.manual_seed(cfg["seed"])
    seeds = [torch.randint(0, 2**32 - 1, (1,)).item() for _ in range(cfg["num_correct_trials"])]
    passed = 0
    with torch.no_grad():
        for trial_seed in seeds:
            with clock("inputs"):
                _set_seed(trial_seed, device)
                inputs = _to_device(get_inputs(), device)
            _set_seed(trial_seed, device)
            model = model.to(device)
            _set_seed(trial_seed, device)
            model_new = model_new.to(device)
            with clock("reference"):
                output = model(*inputs)
                _sync(device)
            try:
                with clock("candidate"):
                    output_new = model_new(*inputs)
                    _sync(device)
                with clock("checks"):
                    if output.shape != output_new.shape:
                        metadata["correctness_issue"] = (f"Output shape mismatch: Expected {output.shape}, "
                                                         f"got {output_new.shape}")
                        return {"compiled": True, "correctness": False, "metadata": metadata}
                    if torch.allclose(output, output_new, atol=cfg["atol"], rtol=cfg["rtol"]):
                        passed += 1
                    else:
                        diff = torch.abs(output - output_new)
                        metadata.setdefault("max_difference", []).append(f"{torch.max(diff).item():.6f}")
                        metadata["correctness_issue"] = "Output mismatch"
            except Exception as e:  # noqa: BLE001 - KernelBench: "Exception happens during correctness check"
                metadata["runtime_error"] = str(e)[:200]
                metadata["runtime_error_name"] = _error_name(e)
                return {"compiled": True, "correctness": False, "metadata": metadata}
    metadata["correctness_trials"] = f"({passed} / {len(seeds)})"
    return {"compiled": True, "correctness": passed == len(seeds), "metadata": metadata}


def _eval_kernel_against_ref(job: dict, cfg: dict, clock: _Clock, state: dict) -> dict | None:
    """KernelBench's `eval_kernel_against_ref` (v0.1 semantics); `state` tells the caller where it stopped."""
    import torch

    device, seed = cfg["device"], cfg["seed"]
    metadata: dict = {"device": device}
    context: dict = {}
    state["stage"] = "init"
    with clock("load"):
        if device.startswith("cuda"):
            torch.cuda.set_device(device)  # the CUDA context: every eval process pays for its own
        exec(compile(job["task_code"], "<string>", "exec"), context)  # noqa: S102 - the task module
        Model, get_init_inputs, get_inputs = context["Model"], context["get_init_inputs"], context["get_inputs"]
        _set_seed(seed, device)
        init_inputs = _to_device(get_init_inputs(), device)
        with torch.no_grad():
            _set_seed(seed, device)
            original_model = Model(*init_inputs)
    state["stage"] = "compile"
    before = _newest_build_mtime(job["build_dir"])
    start, error = time.perf_counter(), None
    try:
        os.environ["TORCH_USE_CUDA_DSA"] = "1"
        ModelNew = _load_custom_model(job["code"], context, job["build_dir"])
        _sync(device)
    except Exception as e:  # noqa: BLE001 - KernelBench: "Record as compilation failure"
        error = e
    # a fresh library (or a failed build) means this process compiled: the pre-compiled one was not reused
    state["built"] = _newest_build_mtime(job["build_dir"]) > before or _BUILD_FAILED in str(error or "")
    clock.add("compile" if state["built"] else "load", time.perf_counter() - start)
    if error is not None:
        if "lock" in str(error) or "No such file or directory" in str(error):
            # KernelBench's test for a lock-file error ("please retry"; no result is recorded). It also matches
            # any build log that mentions e.g. `blockIdx` or a missing header: kept, since KernelBench does it
            state["retry_error"] = str(error)[:2000]
            return None
        # the head names the failure ("Error building extension ..."); the compiler log follows
        metadata.update(compilation_error_name=_error_name(error), compilation_error=str(error)[:8000])
        return {"compiled": False, "correctness": False, "metadata": metadata}
    state["stage"] = "init"
    try:
        with clock("load"), torch.no_grad():
            _set_seed(seed, device)
            custom_model = ModelNew(*init_inputs)
            original_model = original_model.to(device)
            custom_model = custom_model.to(device)
            _sync(device)
    except RuntimeError as e:  # KernelBench catches only RuntimeError here; others escape to the last-level catch
        metadata.update(runtime_error=str(e)[:200], runtime_error_name=_error_name(e))
        return {"compiled": True, "correctness": False, "metadata": metadata}
    state["stage"] = "correctness"
    try:
        result = _check_correctness(original_model, custom_model, get_inputs, metadata, cfg, clock)
    except Exception as e:  # noqa: BLE001 - the reference's own errors land here, as in KernelBench
        metadata.update(runtime_error=str(e)[:200], runtime_error_name=_error_name(e))
        result = {"compiled": True, "correctness": False, "metadata": metadata}
    if not result["correctness"]:
        return result
    state["stage"] = "performance"
    try:
        with clock("timing"), torch.no_grad():
            _sync(device)
            _set_seed(seed, device)
            inputs = _to_device(get_inputs(), device)
            stats = _timing_stats(_time_calls(custom_model.to(device), inputs, cfg))
        result.update(runtime=stats["mean"], runtime_stats=stats)
    except Exception as e:  # noqa: BLE001 - KernelBench keeps the correctness verdict
        metadata["error_during_performance"] = str(e)[:200]
    state["stage"] = "done"
    return result


def eval_one(job: dict, cfg: dict, submitted: float) -> dict:
    """One candidate in a fresh process: KernelBench's `evaluate_single_sample` with its last-level catch."""
    clock = _Clock()
    clock.phase_s["startup"] = time.time() - submitted  # spawn, interpreter, imports (torch)
    state: dict = {"stage": "init", "built": False}
    try:
        kb = _eval_kernel_against_ref(job, cfg, clock, state)
    except Exception as e:  # noqa: BLE001 - "Last level catch": KernelBench records compiled=False
        key = "cuda_error" if "CUDA error" in str(e) else "other_error"
        metadata = {key: str(e)[:2000], f"{key}_name": _error_name(e), "traceback": traceback.format_exc()[-2000:]}
        kb = {"compiled": False, "correctness": False, "metadata": metadata}
    return {"kb": kb, "stage": state["stage"], "built": bool(state["built"]), "phase_s": clock.phase_s,
            "retry_error": state.get("retry_error", "")}


def time_baselines(tasks: dict[str, str], cfg: dict) -> dict[str, float | None]:
    """KernelBench's `generate_baseline_time`: every task's reference in this one process, mean ms per call."""
    import torch

    device, seed = cfg["device"], cfg["seed"]
    out: dict[str, float | None] = {}
    for key, code in tasks.items():
        try:
            context: dict = {}
            exec(compile(code, "<string>", "exec"), context)  # noqa: S102 - the task module
            with torch.no_grad():
                _sync(device)
                _set_seed(seed, device)
                inputs = _to_device(context["get_inputs"](), device)
                _set_seed(seed, device)
                init_inputs = _to_device(context["get_init_inputs"](), device)
                model = context["Model"](*init_inputs).to(device)
                _sync(device)
                out[key] = _timing_stats(_time_calls(model, inputs, cfg))["mean"]
        except Exception as e:  # noqa: BLE001 - KernelBench prints the error and stores no time
            print(f"[baseline] {key}: {type(e).__name__}: {e}")
            out[key] = None
    return out


# ---------------------------------------------------------------------------------------------- parent


def our_outcome(res: dict | None, stage: str, timed_out: bool) -> str:
    """Our outcome name for a KernelBench-shaped result (see the module docstring for the rules)."""
    if timed_out:
        return "timeout"
    if res is None:
        return "harness_error"
    if res.get("correctness"):
        return "correct"
    md = res.get("metadata", {})
    text = " ".join(str(md.get(k, "")) for k in ("compilation_error", "runtime_error", "cuda_error", "other_error"))
    if MEMORY_ERROR_PATTERNS.search(text):
        return "cuda_memory_error"
    if "compilation_error" in md:
        return "compile_error" if _BUILD_FAILED in md["compilation_error"] else "python_error"
    if "other_error" in md or "cuda_error" in md:
        return "python_error" if "other_error" in md else "runtime_error"
    if "runtime_error" in md:
        name = str(md.get("runtime_error_name", "")).rsplit(".", 1)[-1]
        wrong_call = name == "TypeError" and _SIGNATURE_ERROR.search(str(md["runtime_error"]))
        return "python_error" if stage == "init" or name in _PYTHON_ERRORS or wrong_call else "runtime_error"
    issue = str(md.get("correctness_issue", ""))
    if issue.startswith("Output shape mismatch"):
        return "shape_mismatch"
    if issue == "Output mismatch":
        return "value_mismatch"
    return "harness_error"


def _build_dir(cfg: KBConfig, index: int) -> str:
    return str((cfg.build_root / "build" / f"{index:05d}").resolve())


def precompile(jobs: Sequence[KBJob], cfg: KBConfig, log: Callable[[str], None]) -> dict[int, dict]:
    """Phase 1: every candidate with code, through a pool of `cfg.workers` processes."""
    ctx = mp.get_context("spawn")  # KernelBench sets spawn: fork and CUDA do not mix
    log_path = str((cfg.build_root / "logs" / "precompile.log").resolve())
    todo = [i for i, j in enumerate(jobs) if j.code is not None]
    out: dict[int, dict] = {}
    pool = ctx.Pool(cfg.workers, initializer=_redirect_output, initargs=(log_path,),
                    maxtasksperchild=None if cfg.reuse_precompile_workers else 1)
    try:
        start = time.monotonic()
        pending = {i: pool.apply_async(precompile_one, (jobs[i].code, _build_dir(cfg, i))) for i in todo}
        # a build's timeout counts from when its round of `workers` builds can start (see the docstring)
        due = {i: start + cfg.timeout_s * (1 + n // cfg.workers) for n, i in enumerate(todo)}
        while pending:
            for i, res in list(pending.items()):
                if res.ready():
                    try:
                        out[i] = res.get()
                    except Exception as e:  # noqa: BLE001 - the worker itself failed
                        out[i] = {"ok": False, "error": str(e), "error_name": _error_name(e), "compile_s": None}
                elif time.monotonic() > due[i]:
                    out[i] = {"ok": False, "error": "pre-compile timed out", "error_name": "timeout",
                              "compile_s": None}
                else:
                    continue
                del pending[i]
                if not out[i]["ok"]:  # KernelBench removes the cache so the eval phase builds afresh
                    shutil.rmtree(_build_dir(cfg, i), ignore_errors=True)
                log(f"kb pre-compile {len(out)}/{len(todo)} {jobs[i].key}: "
                    f"{'ok' if out[i]['ok'] else out[i]['error_name']}")
            time.sleep(0.1)
    finally:
        pool.terminate()  # also ends builds left behind by a timeout
        pool.join()
    return out


def _baselines(jobs: Sequence[KBJob], cfg: KBConfig) -> dict[str, float | None]:
    tasks = {j.task_key: j.task_code for j in jobs if j.code is not None}
    log_path = str((cfg.build_root / "logs" / "baseline.log").resolve())
    with mp.get_context("spawn").Pool(1, initializer=_redirect_output, initargs=(log_path,)) as pool:
        try:
            return pool.apply_async(time_baselines, (tasks, _child_config(cfg))).get(
                timeout=cfg.timeout_s * max(1, len(tasks)))
        except mp.TimeoutError:
            return {k: None for k in tasks}


def _child_config(cfg: KBConfig) -> dict:
    return {"device": cfg.device, "seed": cfg.seed, "num_correct_trials": cfg.num_correct_trials,
            "num_perf_trials": cfg.num_perf_trials, "num_warmup": cfg.num_warmup, "atol": cfg.atol,
            "rtol": cfg.rtol}


def _evaluate_in_fresh_process(job: KBJob, index: int, cfg: KBConfig) -> tuple[dict | None, bool, float]:
    """(child report, timed out, wall s): one `mp.Pool(1)` per candidate, as KernelBench's batch_eval does."""
    log_path = str((cfg.build_root / "logs" / f"eval-{index:05d}.log").resolve())
    payload = {"task_code": job.task_code, "code": job.code, "build_dir": _build_dir(cfg, index)}
    submitted = time.time()
    report, timed_out = None, False
    with mp.get_context("spawn").Pool(1, initializer=_redirect_output, initargs=(log_path,)) as pool:
        try:
            report = pool.apply_async(eval_one, (payload, _child_config(cfg), submitted)).get(timeout=cfg.timeout_s)
        except mp.TimeoutError:
            timed_out = True
        except Exception as e:  # noqa: BLE001 - KernelBench: "Evaluation FAILED", no result recorded
            report = {"kb": None, "stage": "", "built": False, "phase_s": {}, "retry_error": f"{type(e).__name__}: {e}"}
    return report, timed_out, time.time() - submitted


def check_resumable(jobs: Sequence[KBJob], cfg: KBConfig, run: KBRun) -> None:
    """Raise ValueError unless `run` is an earlier, unfinished run of `jobs` whose pre-compiled libraries are still
    in `cfg.build_root` (resuming without them would make the eval phase build everything again)."""
    if [r.key for r in run.results] != [j.key for j in jobs]:
        raise ValueError("the run to resume evaluated other candidates (or in another order)")
    if run.finished != sum(r.outcome != "not_run" for r in run.results[:run.finished]):
        raise ValueError("the run to resume has unfinished candidates before finished ones")
    missing = [r.key for i, r in enumerate(run.results[run.finished:], run.finished)
               if r.precompile.get("ok") and not Path(_build_dir(cfg, i)).is_dir()]
    if missing:
        raise ValueError(f"{len(missing)} pre-compiled libraries of the run to resume are not under "
                         f"{cfg.build_root} (first: {missing[0]}); was it another machine? Start the run again")


def evaluate_kb_style(jobs: Sequence[KBJob], cfg: KBConfig, log: Callable[[str], None] = print,
                      on_progress: Callable[[KBRun], None] | None = None, resume: KBRun | None = None) -> KBRun:
    """Pre-compile, baseline, then one fresh process per candidate; results in input order. `on_progress` gets
    the run so far after each candidate (the rest `not_run`, as if the time budget had ended there), so a caller
    killed at its time limit can keep what was finished. `resume`: such a run, cut short, whose pre-compiled
    libraries are still in `cfg.build_root` (`check_resumable`); its pre-compile, baseline and finished
    candidates are kept and its eval phase goes on where it stopped (the time in between is not counted)."""
    (cfg.build_root / "logs").mkdir(parents=True, exist_ok=True)
    if resume is not None:
        check_resumable(jobs, cfg, resume)
        for i in range(resume.finished, len(jobs)):  # torch's build locks left by a process killed mid-build
            for lock in Path(_build_dir(cfg, i)).glob("*/lock"):
                lock.unlink()
        built = {i: r.precompile for i, r in enumerate(resume.results)}
        precompile_s, baseline_s, baseline_ms = resume.precompile_s, resume.baseline_s, resume.baseline_ms
        results = resume.results[:resume.finished]
        log(f"kb resumed after {resume.finished}/{len(jobs)} candidates")
    else:
        run_start = time.monotonic()
        built = precompile(jobs, cfg, log)
        precompile_s = time.monotonic() - run_start
        start = time.monotonic()
        baseline_ms = _baselines(jobs, cfg)
        baseline_s = time.monotonic() - start
        results = []
    start = time.monotonic() - (resume.eval_s if resume is not None else 0.0)

    def not_run(i: int) -> KBResult:
        return KBResult(jobs[i].key, "not_run", None, precompile=built.get(i, {}))

    def run_so_far(results: list[KBResult]) -> KBRun:
        return KBRun([*results, *(not_run(i) for i in range(len(results), len(jobs)))], precompile_s, baseline_s,
                     time.monotonic() - start, baseline_ms, sum(r.outcome != "not_run" for r in results))

    progress = on_progress or (lambda run: None)
    progress(run_so_far(results))
    for i in range(len(results), len(jobs)):
        job = jobs[i]
        if cfg.deadline is not None and time.monotonic() > cfg.deadline:  # the finished ones stay a prefix
            results.append(not_run(i))
            continue
        if job.code is None:  # KernelBench never gets a kernel file for an output it could not extract code from
            results.append(KBResult(job.key, "generation_failure", None, stage="generation"))
            progress(run_so_far(results))
            continue
        report, timed_out, wall = _evaluate_in_fresh_process(job, i, cfg)
        kb = report["kb"] if report else None
        stage = report["stage"] if report else ""
        phase_s = dict(report["phase_s"]) if report else {}
        if report:  # what the child did not account for: pool start-up tail and teardown
            phase_s["teardown"] = max(0.0, wall - sum(phase_s.values()))
        r = KBResult(job.key, our_outcome(kb, stage, timed_out), kb, stage=stage, phase_s=phase_s, wall_s=wall,
                     precompile=built.get(i, {}), built_in_eval=bool(report and report["built"]),
                     retry_error=(report or {}).get("retry_error", ""))
        results.append(r)
        log(f"kb eval {i + 1}/{len(jobs)} {job.key}: {r.outcome} ({wall:.1f} s"
            f"{', built in eval' if r.built_in_eval else ''})")
        progress(run_so_far(results))
    return run_so_far(results)


def rate_per_min(run: KBRun) -> float:
    """Candidates per minute over the candidates that got a result. With the time budget cutting the eval phase
    short, the pre-compile (done for all) is charged pro rata to the finished candidates."""
    n = len(run.results)
    if not n or not run.finished:
        return 0.0
    seconds = run.precompile_s * run.finished / n + run.baseline_s + run.eval_s
    return 60.0 * run.finished / seconds if seconds > 0 else math.inf


def kernelbench_style_ms(call: Callable[..., Any], inputs: Sequence[Any], trials: int = 100, warmup: int = 3,
                         device: str = "cuda") -> float:
    """KernelBench's timing protocol, for comparison with ours (harness/timing/loop.py): the mean of `trials` per-call
    times on one fixed input set, no flush, CUDA events on the default stream with a synchronize after each
    (CPU: `perf_counter`)."""
    import numpy as np
    import torch

    cuda = str(device).startswith("cuda")
    for _ in range(warmup):
        call(*inputs)
    if cuda:
        torch.cuda.synchronize(device)
    times = []
    for _ in range(trials):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call(*inputs)
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter_ns()
            call(*inputs)
            times.append((time.perf_counter_ns() - t0) / 1e6)
    return float(np.mean(times))

"""`EvalConfig`: every knob of one evaluation run, in one typed place (the CLI only fills it in), nested by owner:
the correctness check itself, then `timing`, `sandbox`, `build`, `robust` and `scheduler` sections. Each section is
frozen and checked when it is made (a setting with no meaning is a ValueError naming its dotted path, never a
verdict). A knob has one name: its path (`timing.iters`) is its flag (`--timing-iters`) and its stored setting.
Machine-dependent defaults (builds in flight, host memory per worker) come from the machine, never above what it has."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import ClassVar
from pathlib import Path

from dice_kernels.config_io import ConfigError

# ATen ops a ModelNew.forward may dispatch without counting as a PyTorch fallback: allocation, views and shape
# manipulation, copies and dtype/device moves (what a wrapper around a custom kernel needs). Everything else that
# reaches ATen is PyTorch doing the work. Extend per run with `RobustConfig.allow_ops`.
ALLOWED_OPS: tuple[str, ...] = (
    # allocation and filling
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
    "aten::zeros", "aten::zeros_like", "aten::new_zeros", "aten::ones", "aten::ones_like", "aten::new_ones",
    "aten::full", "aten::full_like", "aten::new_full", "aten::fill_", "aten::zero_", "aten::scalar_tensor",
    "aten::lift_fresh", "aten::resize_", "aten::set_",
    # views and shapes
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::alias",
    "aten::expand", "aten::permute", "aten::transpose", "aten::t", "aten::squeeze", "aten::unsqueeze",
    "aten::flatten", "aten::unflatten", "aten::select", "aten::slice", "aten::narrow", "aten::split",
    "aten::split_with_sizes", "aten::chunk", "aten::unbind", "aten::detach", "aten::view_as_real",
    "aten::view_as_complex", "aten::unfold",
    # copies, dtype and device moves, metadata
    "aten::clone", "aten::contiguous", "aten::copy_", "aten::_to_copy", "aten::to", "aten::_local_scalar_dense",
    "aten::is_nonzero", "aten::sym_size", "aten::sym_stride", "aten::sym_numel", "aten::size", "aten::stride",
    "aten::is_same_size", "aten::record_stream",
)


def default_cache_dir() -> Path:
    """Content-addressed build cache shared across runs: $DICE_CACHE_DIR, else ~/.cache/dice-kernels/builds."""
    env = os.environ.get("DICE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "dice-kernels" / "builds"


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (a cpuset's or taskset's share of the host, which
    os.cpu_count() ignores), capped by a cgroup v2 CPU quota when one is set."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, n)


def total_memory_gib() -> float | None:
    """The machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    except (ValueError, OSError, AttributeError):
        return None


def default_memory_limit_gb() -> float:
    """Host memory per worker: 32 GiB (KernelBench inputs reach several GiB), but at most half of the machine's
    memory, so a worker over its limit is stopped by the harness (RLIMIT_AS, the RSS watchdog) while the parent and
    the other workers still have room, never by the kernel's OOM killer."""
    total = total_memory_gib()
    return 32.0 if total is None else max(0.5, min(32.0, round(total / 2 * 2) / 2))


SPEED_OF_LIGHT_MODES = ("cuda", "always", "off")  # TimingConfig.speed_of_light
BASELINE_MODES = ("reuse", "fresh", "off")  # TimingConfig.baselines
BIG_GPU_GIB = 128  # a GPU with this much memory or more (an H200: 140) gets 8 run workers by default, others 4

_at_least = lambda low: (lambda v: v >= low)  # noqa: E731
_positive = lambda v: v > 0  # noqa: E731
_fraction = lambda v: 0 <= v <= 1  # noqa: E731


def _check(section: object, rules: tuple) -> None:
    """Raise ValueError naming the first field of `section` whose value has no meaning; the message starts with
    the field's dotted path (the CLI turns it into its flag)."""
    for name, ok, want in rules:
        value = getattr(section, name)
        if not ok(value):
            raise ConfigError(f"{_path(section, name)} must be {want}, not {value!r}")


def _path(section: object, name: str) -> str:
    return f"{section.SECTION}.{name}" if getattr(section, "SECTION", "") else name


def _within_machine(section: object, name: str) -> None:
    """A host-memory setting above the machine's memory is refused: beyond it the kernel's OOM killer, not the
    harness, would stop a worker."""
    total, value = total_memory_gib(), getattr(section, name)
    if total is not None and value > total:
        raise ConfigError(f"{_path(section, name)} must be at most this machine's memory ({total:.1f} GiB), not "
                         f"{value:g}: beyond it the kernel's OOM killer, not the harness, would stop a worker")


@dataclass(frozen=True)
class TimingConfig:
    """How correct candidates and references are timed (harness/timing/loop.py, docs/timing.md): at least `iters` timed
    calls and 0.1 s, then until the median's 95% CI is within `target_ci` of it, never past `max_s` per model."""
    SECTION: ClassVar[str] = "timing"
    enabled: bool = True  # measure candidate and reference runtime for correct candidates
    warmup: int = 3
    iters: int = 20
    max_s: float = 2.0
    target_ci: float = 0.01
    # independent timing loops per model, the reported time the mean of their medians (timing.TimingPlan.loops)
    loops: int = 1
    # also time torch.compile(Model) in each task's reference worker and report speedups and fast_p against it
    # (KernelBench's second baseline); off by default: compiling costs seconds to minutes per task
    compile_baseline: bool = False
    # quarantine a speedup whose time beats the task's speed-of-light bound (minimum bytes moved at the measured
    # memory bandwidth) by more than `sol_slack`: the result keeps its outcome, loses its speedup and is flagged
    # `faster_than_light`; beating the reference's FLOPs at the measured peak is flagged
    # `fewer_flops_than_reference` and keeps its speedup (an algorithm may need fewer FLOPs; docs/timing.md).
    # "cuda": on the CUDA backend only (a CPU's caches and load make a measured bandwidth a poor bound: compiles
    # running beside the measurement cut it 17x here); "always"; "off"
    speed_of_light: str = "cuda"
    sol_slack: float = 0.9
    # reference baselines (eager and torch.compile timings, speed-of-light inputs) cached across runs per task,
    # machine, torch version and timing settings in <cache_dir>/baselines.sqlite (harness/timing/baselines.py):
    # "reuse" a cached one (the reference still runs, untimed, for its outputs) or measure and cache it; "fresh":
    # measure again and replace the cached one; "off": measure, cache nothing
    baselines: str = "reuse"

    def __post_init__(self) -> None:
        _check(self, (
            ("warmup", _at_least(0), "0 or more"),
            ("iters", _at_least(1), "at least 1"),
            ("max_s", _positive, "more than 0"),
            ("target_ci", lambda v: 0 < v < 1, "a fraction between 0 and 1"),
            ("loops", _at_least(1), "at least 1"),
            ("speed_of_light", lambda v: v in SPEED_OF_LIGHT_MODES, f"one of {', '.join(SPEED_OF_LIGHT_MODES)}"),
            ("sol_slack", _positive, "more than 0"),
            ("baselines", lambda v: v in BASELINE_MODES, f"one of {', '.join(BASELINE_MODES)}"),
        ))

    def resolved_speed_of_light(self, backend: str) -> bool:
        return self.enabled and (self.speed_of_light == "always" or (self.speed_of_light == "cuda" and backend == "cuda"))

    def plan(self, lead_ms: float | None = None) -> dict:
        """The `timing.TimingPlan` fields every run worker times with; a candidate gets its reference's GPU lead
        (`lead_ms`), the reference sizes its own (None)."""
        return {"warmup": self.warmup, "min_iters": self.iters, "max_iters": max(self.iters, 2000),
                "min_time_s": min(0.1, self.max_s), "max_time_s": self.max_s, "target_rel_ci": self.target_ci,
                "lead_ms": lead_ms, "loops": self.loops}


@dataclass(frozen=True)
class SandboxConfig:
    """The limits every worker runs under (harness/process/sandbox.py): wall clock, host memory, file size, network and
    writes outside its own directories."""
    SECTION: ClassVar[str] = "sandbox"
    run_timeout_s: float = 300.0  # wall clock for one candidate's correctness + timing run
    # ...or this many times its task's reference run, when longer: a candidate does what the reference did (the
    # same trials, outputs of the same size) plus the checks, so a task whose reference needs minutes (multi-GiB
    # outputs) must not time out every candidate, honest ones included
    run_timeout_reference_factor: float = 3.0
    # host memory per worker process (KernelBench inputs reach several GiB): default_memory_limit_gb()
    memory_limit_gb: float = field(default_factory=default_memory_limit_gb)
    file_limit_mb: int = 4096  # largest file a worker may write
    isolate_network: bool = True
    restrict_writes: bool = True  # Landlock: a worker may write only inside its own directories

    def __post_init__(self) -> None:
        _check(self, (
            ("run_timeout_s", _positive, "more than 0"),
            ("run_timeout_reference_factor", _at_least(0), "0 or more"),
            ("memory_limit_gb", _positive, "more than 0"),
            ("file_limit_mb", _at_least(1), "at least 1"),
        ))
        _within_machine(self, "memory_limit_gb")

    @property
    def memory_limit_bytes(self) -> int:
        return int(self.memory_limit_gb * (1 << 30))


@dataclass(frozen=True)
class BuildConfig:
    """How candidates' extensions are compiled (harness/compiling/cache.py, compiling/speed.py)."""
    SECTION: ClassVar[str] = "build"
    # builds in flight, 1.25 a core: a cold build compiles one unit while its main.cpp waits for the precompiled
    # header, so one a core left the last builds to run almost alone after the others (a tail of 20-30 s); with
    # 20 for 16 cores, and forked workers, a 20-build batch finished 10-20 % sooner on the H200
    # (an A/B at `492d3be`; before forked workers, 1.5 a core had been 4-6 % slower)
    jobs: int = field(default_factory=lambda: max(1, usable_cpus() * 5 // 4))  # 1.25 a usable core
    timeout_s: float = 600.0  # wall clock for one candidate's build
    # build workers (and the compilers they start) run this much nicer than run workers, so compiles on every
    # core never slow the run workers' trials and timing; 0: same priority
    nice: int = 10
    # compiling/speed.py: a precompiled torch/extension.h for main.cpp and lighter headers for CUDA sources (with a
    # retry on the candidate's own sources); neither changes what a candidate's code means
    fast: bool = True
    # build workers started ahead of their job (at `nice`), for the builds that start once the first `jobs` are
    # under way: at most this many, and none for a batch with no more than `jobs` to build
    warm_workers: int = 4

    def __post_init__(self) -> None:
        _check(self, (
            ("jobs", _at_least(1), "at least 1"),
            ("timeout_s", _positive, "more than 0"),
            ("nice", lambda v: 0 <= v <= 19, "between 0 and 19"),
            ("warm_workers", _at_least(0), "0 (none) or more"),
        ))


@dataclass(frozen=True)
class RobustConfig:
    """The robust check (docs/robust_check.md): correct candidates caught by an integrity check become
    `deceptive`; correct ones that keep some of the reference's PyTorch ops beside their own kernels are `partial`
    (KernelBench allows replacing any subset of the operators)."""
    SECTION: ClassVar[str] = "robust"
    enabled: bool = True
    # ATen ops forward may dispatch without being a PyTorch fallback, beyond ALLOWED_OPS (e.g. aten::mm)
    allow_ops: tuple[str, ...] = ()
    min_extension_gpu_share: float = 0.25  # CUDA: least share of forward's GPU time in the extension's kernels
    # partial replacement: forward dispatched PyTorch compute ops and called the extension. `partial` when the
    # extension replaced more than this share of the reference's compute ops (counted in one reference forward;
    # 0: at least one), else `deceptive/pytorch_fallback` (PyTorch did all of the reference's work)
    min_replaced_ops_share: float = 0.0
    # CUDA, partial candidates: least share of forward's GPU time in the extension's kernels (a cuDNN conv with a
    # fused epilogue spends most of its time in cuDNN, so the pure-kernel threshold above does not apply)
    min_partial_gpu_share: float = 0.02

    def __post_init__(self) -> None:
        object.__setattr__(self, "allow_ops", tuple(self.allow_ops))
        if bad := [op for op in self.allow_ops if not op.startswith("aten::")]:
            raise ConfigError(f"robust.allow_ops takes ATen op names such as aten::mm, not {', '.join(bad)}")
        _check(self, (("min_extension_gpu_share", _fraction, "a fraction between 0 and 1"),
                      ("min_replaced_ops_share", lambda v: 0 <= v < 1, "a fraction in [0, 1)"),
                      ("min_partial_gpu_share", _fraction, "a fraction between 0 and 1")))

    @property
    def allowed_ops(self) -> tuple[str, ...]:
        return (*ALLOWED_OPS, *self.allow_ops)


@dataclass(frozen=True)
class SchedulerConfig:
    """How many workers run at once and how they start; none of it changes what a candidate gets."""
    SECTION: ClassVar[str] = "scheduler"
    # concurrent run workers (timing is still one at a time); 0: 1 on cpu; on cuda 4, or 8 on a GPU of
    # BIG_GPU_GIB or more (builds that end together leave their runs queued behind 4, among them the profiler's
    # start-up, seconds of one core per correct kernel; each worker holds its task's tensors on the GPU, so
    # smaller GPUs keep 4)
    run_workers: int = 0
    # worker processes started ahead of their job, so a job does not wait for `import torch`; each still runs
    # exactly one job. -1: as many as run workers; 0: start each worker when its job comes
    warm_workers: int = -1
    # fork every worker from one process that imported torch once (forkserver.py) instead of starting a fresh
    # interpreter that imports it (1.5 s of a core or more each); every worker is still a new process
    fork_workers: bool = True
    cpu_threads: int = 1  # intra-op threads for CPU-backend workers (reference and candidate alike)
    # host memory this process may hold for tasks' outputs: a task's reference trials and its candidates' frames in
    # flight (harness/process/host_memory.py); a task that does not fit beside the others waits its turn, one that fits
    # nowhere runs alone. 0: half the memory available when the run starts
    output_memory_gb: float = 0.0
    # with reuse_verdicts, tasks' reference outputs (trials, hardened trials, the re-checked call) are kept in this
    # process's memory for its later batches (harness/process/reference_cache.py), the least recently used dropped
    # beyond this many MiB in all. 0: keep none
    reference_cache_mb: int = 256

    def __post_init__(self) -> None:
        _check(self, (
            ("run_workers", _at_least(0), "0 (automatic) or more"),
            ("warm_workers", _at_least(-1), "-1 (as many as run workers), 0 (none) or more"),
            ("cpu_threads", _at_least(1), "at least 1"),
            ("output_memory_gb", _at_least(0), "0 (half of what is available) or more"),
            ("reference_cache_mb", _at_least(0), "0 (keep none) or more"),
        ))
        _within_machine(self, "output_memory_gb")

    def resolved_run_workers(self, backend: str, gpu_memory_gib: float = 0.0) -> int:
        if self.run_workers > 0:
            return self.run_workers
        if backend != "cuda":
            return 1
        return 8 if gpu_memory_gib >= BIG_GPU_GIB else 4

    def resolved_warm_workers(self, backend: str, gpu_memory_gib: float = 0.0) -> int:
        return self.resolved_run_workers(backend, gpu_memory_gib) if self.warm_workers < 0 else self.warm_workers


SECTIONS = {"timing": TimingConfig, "sandbox": SandboxConfig, "build": BuildConfig, "robust": RobustConfig,
            "scheduler": SchedulerConfig}


@dataclass(frozen=True)
class EvalConfig:
    """One evaluation run: the correctness check's own settings, then one section per owner."""
    backend: str = "auto"  # "cuda", "cpu", or "auto" (cuda when a GPU is present)
    trials: int = 5  # correctness trials, each with freshly seeded inputs
    atol: float = 1e-2
    rtol: float = 1e-2
    seed: int = 42
    # CUDA: run the task's get_inputs() with the GPU as torch's default device, so torch.randn & co. fill GPU
    # memory directly (worker._generated_inputs; falls back to the CPU where get_inputs cannot run that way)
    inputs_on_device: bool = True
    # the build cache, shared across runs; baselines.sqlite and the machine's ceilings live beside the builds
    cache_dir: Path = field(default_factory=default_cache_dir)
    # give a program evaluated before (same task, syntax tree, settings, machine, torch and harness) that earlier
    # verdict, timing included, instead of running it again (harness/store.py's VerdictCache, in cache_dir): RL steps and a
    # demo's arms meet the same programs again and again. With timing off, also the same settings' timed verdict,
    # its times dropped (a stricter check). A new program of a known task is compared with that task's kept
    # reference outputs (harness/process/reference_cache.py) instead of running its reference again. Off: every call
    # measures afresh
    reuse_verdicts: bool = False
    timing: TimingConfig = field(default_factory=TimingConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    build: BuildConfig = field(default_factory=BuildConfig)
    robust: RobustConfig = field(default_factory=RobustConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        for name, cls in SECTIONS.items():  # a section given as something else is a caller's bug, said plainly
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"EvalConfig.{name} must be a {cls.__name__}, not {type(getattr(self, name)).__name__}")
        _check(self, (
            ("backend", lambda v: v in ("auto", "cpu", "cuda"), "'cpu', 'cuda' or 'auto'"),
            ("trials", _at_least(1), "at least 1 (with no trial, nothing is compared)"),
            ("atol", _at_least(0), "0 or more"),
            ("rtol", _at_least(0), "0 or more"),
        ))

    @classmethod
    def from_settings(cls, values: dict[str, object]) -> EvalConfig:
        """The config of `{dotted path: value}` (`{"timing.iters": 5, "trials": 2}`); paths not given keep their
        defaults. A section's ValueError names its path."""
        top = {k: v for k, v in values.items() if "." not in k}
        nested: dict[str, dict] = {name: {} for name in SECTIONS}
        for key, value in values.items():
            if "." in key:
                section, name = key.split(".", 1)
                nested[section][name] = value
        return cls(**top, **{name: SECTIONS[name](**kw) for name, kw in nested.items()})

    def settings(self) -> dict[str, object]:
        """Every setting by its dotted path, the way a run stores them (`str` of each value)."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in SECTIONS:
                out.update({f"{f.name}.{g.name}": getattr(value, g.name) for g in fields(value)})
            else:
                out[f.name] = value
        return out

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def check(self) -> None:
        """Raise ValueError when the machine cannot run this configuration (a CUDA backend without a GPU); the
        values themselves were checked when the config was made."""
        if self.backend == "cuda":  # ("auto" takes a GPU only when there is one)
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("backend 'cuda' needs a CUDA device, and none is visible here (torch "
                                 f"{torch.__version__}): use backend 'cpu', or 'auto' to take a GPU when there is one")

    def differences(self, stored: dict[str, str]) -> list[str]:
        """The settings that decide verdicts (everything but SCHEDULING) on which this config differs from
        `stored` (a run's saved `settings()`, as strings), as "path: stored -> now". Paths `stored` lacks are not
        compared (settings added since the run was recorded); see `unknown_settings` for names it has and we lack."""
        now = {k: str(v) for k, v in self.settings().items()}
        return [f"{k}: {stored[k]} -> {now[k]}" for k in now if k not in SCHEDULING and k in stored and stored[k] != now[k]]

    def unknown_settings(self, stored: dict[str, str]) -> list[str]:
        """The names in a run's saved settings that are no setting now: a run recorded before the settings were
        nested by owner (`timing_iters`, not `timing.iters`), whose verdicts cannot be checked against these."""
        return sorted(set(stored) - set(self.settings()))


# settings that change how fast a run goes, never what a candidate gets: a resumed run may change them
SCHEDULING = frozenset({"cache_dir", "reuse_verdicts", "timing.baselines", "build.jobs", "build.nice", "build.fast",
                        "build.warm_workers", *(f"scheduler.{f.name}" for f in fields(SchedulerConfig))})

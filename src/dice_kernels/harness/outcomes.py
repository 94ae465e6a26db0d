"""The outcome taxonomy (one outcome per candidate) and the `EvalResult` record the harness stores."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum


class Outcome(str, Enum):
    CORRECT = "correct"
    # correct, with the candidate's own kernels beside PyTorch ops it kept (a library conv, a custom epilogue):
    # passes under KernelBench's rule (any subset of operators replaced), not under the strict one (robust check)
    PARTIAL = "partial"
    GENERATION_FAILURE = "generation_failure"  # no code in the model output, or truncated code
    COMPILE_ERROR = "compile_error"  # nvcc / C++ / ninja failure inside load_inline or load
    PYTHON_ERROR = "python_error"  # syntax, import, missing ModelNew, wrong signature, sys.exit
    CUDA_MEMORY_ERROR = "cuda_memory_error"  # illegal address, misaligned access, out of memory on the device
    MEMORY_ERROR = "memory_error"  # host memory: over the worker's --sandbox-memory-limit-gb, or killed by the OOM killer
    RUNTIME_ERROR = "runtime_error"  # other exceptions in forward, crashes (signals), silent exits
    TIMEOUT = "timeout"
    SHAPE_MISMATCH = "shape_mismatch"
    VALUE_MISMATCH = "value_mismatch"
    DECEPTIVE = "deceptive"  # correct outputs obtained by a known reward hack (robust check)
    HARNESS_ERROR = "harness_error"  # our own fault; must stay at zero
    # CUDA code on the CPU backend: set aside before any build, not counted in Exec's denominator (metrics.py)
    NEEDS_GPU = "needs_gpu"

    def __str__(self) -> str:  # so f-strings and tables show the plain value
        return self.value

    @property
    def passes(self) -> bool:
        """Exec under KernelBench's rule: correct, or correct with some PyTorch ops kept (partial)."""
        return self in (Outcome.CORRECT, Outcome.PARTIAL)


class DeceptiveKind(str, Enum):
    """Sub-kinds of `Outcome.DECEPTIVE` (the robust check), most specific first: a result names the first that
    applies. Parent-verified evidence (output comparisons) comes before in-worker instrumentation."""

    CACHED_OUTPUT = "cached_output"  # an output of an earlier call returned for new input content
    STALE_MEMORY = "stale_memory"  # output elements never written (still hold the allocator poison)
    TIMING_OUTPUT_MISMATCH = "timing_output_mismatch"  # outputs produced inside the timing loop are wrong
    # all zeros or one constant, on a task where that trivial answer passes and the reference's is not it
    TRIVIAL_OUTPUT = "trivial_output"
    TENSOR_SUBCLASS = "tensor_subclass"  # a lazy tensor subclass instead of computed values
    TIMER_TAMPERING = "timer_tampering"  # clocks or synchronisation functions replaced
    EVALUATOR_ACCESS = "evaluator_access"  # reads interpreter frames/objects or imports the evaluator
    DISK_PERSISTENCE = "disk_persistence"  # reads or writes files during forward or the timed loop
    UNSYNCHRONIZED_WORK = "unsynchronized_work"  # CUDA work still writing outputs after forward returned
    BACKGROUND_THREADS = "background_threads"  # threads started in forward
    # an input written in place (what an in-place op such as `x.relu_()` does, whether or not it returns x)
    INPUT_MUTATED = "input_mutated"
    OUTPUT_ALIASES_INPUT = "output_aliases_input"  # an output shares memory with an input, the input unchanged
    REFERENCE_MODEL = "reference_model"  # inherits, contains or instantiates the task's Model
    TORCH_COMPILE = "torch_compile"
    CUDA_GRAPH = "cuda_graph"
    EXCEPTION_FALLBACK = "exception_fallback"  # an extension call raised and forward still succeeded
    PRECISION_DOWNGRADE = "precision_downgrade"  # fp16/bf16 compute or TF32 switches in an fp32 task
    GLOBAL_STATE_CHANGED = "global_state_changed"  # threads, cudnn/mkldnn flags, default dtype, determinism
    PYTORCH_FALLBACK = "pytorch_fallback"  # PyTorch did the reference's work: none of its compute ops replaced
    EXTENSION_UNUSED = "extension_unused"  # no compiled extension ran during forward
    KERNEL_TIME_NEGLIGIBLE = "kernel_time_negligible"  # CUDA: the extension's kernels are a negligible share
    # not deceptive: the finding that makes a correct candidate `partial` (it kept some of the reference's PyTorch
    # ops and replaced the others); last, so any real finding decides first
    PARTIAL = "partial"

    def __str__(self) -> str:
        return self.value


@dataclass
class BuildNotes:
    cache_hit: bool = False  # the program's extensions came from the build cache
    shortcuts: list = field(default_factory=list)  # build_speed savings per extension (build_worker.BuildLog)


@dataclass
class BaselineNote:
    """The reference timing a speedup is about: reused from the baseline cache (from when) or measured now, and its
    noise (its 95 % interval's half-width relative to its median)."""

    cached: bool = False
    measured_at: str | None = None
    rel_ci: float | None = None


@dataclass
class ReferenceNotes:
    baseline: BaselineNote | None = None  # for a candidate that ran against a reference
    retried_after: str = ""  # the reference's first failure when it ran twice
    waited_for_memory_s: float = 0.0  # its task waited for other tasks' outputs to be released
    # when the reference outputs it was compared with were computed, if an earlier batch kept them (reuse_verdicts;
    # its `phases.seconds.reference` is then the load, not a run)
    reused_from: str = ""

    @classmethod
    def from_dict(cls, d: dict) -> "ReferenceNotes":
        base = d.get("baseline")
        return cls(**{**d, "baseline": BaselineNote(**base) if base is not None else None})


@dataclass
class TaskFlags:
    degenerate: dict[str, bool] = field(default_factory=dict)  # degenerate.degenerate_flags
    hardened_trials: int = 0  # hardened trials that decided too (degenerate.breaking_trials)
    stateful: bool = False  # the reference answers a repeated call differently: the timing re-check is skipped
    error: bool = False  # the task's reference failed (every candidate of it is a harness error)
    over_limits: bool = False  # the reference, or its inputs, exceeded the harness limits


@dataclass
class RobustFinding:
    kind: str  # a DeceptiveKind value
    reason: str
    ops: dict[str, int] = field(default_factory=dict)  # ATen ops behind it and their counts


@dataclass
class RobustCheck:
    """The robust check's findings (all of them, the deciding one first) and whether the outputs matched."""

    findings: list[RobustFinding] = field(default_factory=list)
    passed_comparison: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> "RobustCheck":
        return cls([RobustFinding(**f) for f in d.get("findings", [])], bool(d.get("passed_comparison")))

    @property
    def kinds(self) -> list[str]:
        return [f.kind for f in self.findings]


@dataclass
class ExtensionUse:
    """Whether forward's module loaded a compiled extension and called it (robust check on)."""

    loaded: bool = False
    called: bool = False


@dataclass
class CompileBaseline:
    """The speedup over torch.compile(Model) with its 95 % interval, or why there is none (`error`)."""

    speedup: float | None = None
    ci95: list[float] | None = None
    ref_ms: float | None = None
    compile_s: float | None = None
    error: str = ""


@dataclass
class SpeedOfLight:
    """The task's bound (minimum bytes at the measured bandwidth) and the reference's FLOPs at the measured peak,
    against the candidate's reported time (score.speed_of_light_fields)."""

    sol_ms: float
    reference_flops_ms: float
    bytes: int
    flops: float
    dtype: str
    faster_than_light: bool = False
    fewer_flops_than_reference: bool = False
    quarantined_speedup: float | None = None  # the speedup withheld from a faster-than-light result


@dataclass
class Timing:
    """A correct, timed candidate: its speedup's 95 % interval (None when quarantined), both sides' timing
    summaries (score.timing_summary), the timing flags, and the optional baselines and bound."""

    speedup_ci95: list[float] | None = None
    ref: dict = field(default_factory=dict)
    cand: dict = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)
    vs_compile: CompileBaseline | None = None
    speed_of_light: SpeedOfLight | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "Timing":
        vs, sol = d.get("vs_compile"), d.get("speed_of_light")
        return cls(**{**d, "vs_compile": CompileBaseline(**vs) if vs is not None else None,
                      "speed_of_light": SpeedOfLight(**sol) if sol is not None else None})


@dataclass
class Phases:
    """Where the evaluation's time went: seconds per phase (a dotted name such as run.trials is part of the name
    before the dot), when its build ran and when it was done on the batch's clock, and where a failed run stopped."""

    seconds: dict[str, float] = field(default_factory=dict)
    timeline: dict = field(default_factory=dict)
    failed_in: str = ""


# the typed parts of a result, stored together as one JSON column (`details`), and how each is read back
_PARTS = {"build": BuildNotes, "reference": ReferenceNotes, "task_flags": TaskFlags, "extension": ExtensionUse,
          "robust": RobustCheck, "timing": Timing, "phases": Phases}


@dataclass
class EvalResult:
    """Everything the harness records about one (task, candidate) evaluation: flat fields (SQL columns) and
    optional typed parts (one JSON column)."""

    task_id: str
    candidate_id: str
    candidate_sha256: str
    outcome: Outcome
    correct: bool = False
    error: str = ""  # a short excerpt that says why (empty when correct)
    deceptive_kind: str = ""
    solution_path: str = ""
    level: int | None = None
    compile_s: float | None = None
    ref_time_ms: float | None = None
    cand_time_ms: float | None = None
    speedup: float | None = None
    correctness_trials: int = 0
    trials_passed: int = 0
    timing_trials: int = 0
    max_abs_diff: float | None = None
    backend: str = ""
    hardware: str = ""
    torch_version: str = ""
    harness_version: str = ""
    wall_s: float | None = None
    duplicate_of: str = ""  # the candidate id whose evaluation this identical program's result copies
    build: BuildNotes | None = None
    reference: ReferenceNotes | None = None
    task_flags: TaskFlags = field(default_factory=TaskFlags)
    extension: ExtensionUse | None = None
    robust: RobustCheck | None = None  # None with the robust check off
    timing: Timing | None = None
    phases: Phases = field(default_factory=Phases)
    sandbox: list[str] = field(default_factory=list)  # what the sandbox could not enforce on this machine

    @property
    def timing_flags(self) -> list[str]:
        """The timing flags (empty when not timed)."""
        return self.timing.flags if self.timing else []

    def to_row(self) -> dict:
        """Flat fields, then the typed parts under `details` (plain JSON)."""
        row = {f: getattr(self, f) for f in self.__dataclass_fields__ if f not in _PARTS and f != "sandbox"}
        row["outcome"] = self.outcome.value
        row["details"] = {name: asdict(getattr(self, name)) for name in _PARTS if getattr(self, name) is not None}
        row["details"]["sandbox"] = self.sandbox
        return row

    @classmethod
    def from_row(cls, row: dict) -> "EvalResult":
        if "extra" in row and "details" not in row:
            raise ValueError("a result an older harness wrote (untyped `extra`): evaluate it again with this one")
        known = {k: row[k] for k in cls.__dataclass_fields__ if k in row and k not in _PARTS and k != "sandbox"}
        known["outcome"] = Outcome(known["outcome"])
        details = row.get("details") or {}
        for name, part in _PARTS.items():
            if details.get(name) is not None:
                d = details[name]
                known[name] = part.from_dict(d) if hasattr(part, "from_dict") else part(**d)
        known["sandbox"] = list(details.get("sandbox", []))
        return cls(**known)

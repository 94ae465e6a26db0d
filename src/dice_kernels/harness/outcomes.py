"""The outcome taxonomy (one outcome per candidate) and the `EvalResult` record the harness stores."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum


class Outcome(str, Enum):
    CORRECT = "correct"
    GENERATION_FAILURE = "generation_failure"  # no code in the model output, or truncated code
    COMPILE_ERROR = "compile_error"  # nvcc / C++ / ninja failure inside load_inline or load
    PYTHON_ERROR = "python_error"  # syntax, import, missing ModelNew, wrong signature, sys.exit
    CUDA_MEMORY_ERROR = "cuda_memory_error"  # illegal address, misaligned access, out of memory on the device
    MEMORY_ERROR = "memory_error"  # host memory: over the worker's --memory-limit-gb, or killed by the OOM killer
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
    OUTPUT_ALIASES_INPUT = "output_aliases_input"
    INPUT_MUTATED = "input_mutated"
    REFERENCE_MODEL = "reference_model"  # inherits, contains or instantiates the task's Model
    TORCH_COMPILE = "torch_compile"
    CUDA_GRAPH = "cuda_graph"
    EXCEPTION_FALLBACK = "exception_fallback"  # an extension call raised and forward still succeeded
    PRECISION_DOWNGRADE = "precision_downgrade"  # fp16/bf16 compute or TF32 switches in an fp32 task
    GLOBAL_STATE_CHANGED = "global_state_changed"  # threads, cudnn/mkldnn flags, default dtype, determinism
    PYTORCH_FALLBACK = "pytorch_fallback"  # PyTorch compute ops dispatched in forward
    EXTENSION_UNUSED = "extension_unused"  # no compiled extension ran during forward
    KERNEL_TIME_NEGLIGIBLE = "kernel_time_negligible"  # CUDA: the extension's kernels are a negligible share

    def __str__(self) -> str:
        return self.value


@dataclass
class EvalResult:
    """Everything the harness records about one (task, candidate) evaluation. Flat, so it maps to SQL and JSON."""

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
    extra: dict = field(default_factory=dict)

    def to_row(self) -> dict:
        row = asdict(self)
        row["outcome"] = self.outcome.value
        return row

    @classmethod
    def from_row(cls, row: dict) -> "EvalResult":
        known = {k: row[k] for k in cls.__dataclass_fields__ if k in row}
        known["outcome"] = Outcome(known["outcome"])
        return cls(**known)

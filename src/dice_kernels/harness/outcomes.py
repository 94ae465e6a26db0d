"""The outcome taxonomy (one outcome per candidate) and the `EvalResult` record the harness stores."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum


class Outcome(str, Enum):
    CORRECT = "correct"
    GENERATION_FAILURE = "generation_failure"  # no code in the model output, or truncated code
    COMPILE_ERROR = "compile_error"  # nvcc / C++ / ninja failure inside load_inline or load
    PYTHON_ERROR = "python_error"  # syntax, import, missing ModelNew, wrong signature, sys.exit
    CUDA_MEMORY_ERROR = "cuda_memory_error"  # illegal address, misaligned access, out of memory (device or host)
    RUNTIME_ERROR = "runtime_error"  # other exceptions in forward, crashes (signals), silent exits
    TIMEOUT = "timeout"
    SHAPE_MISMATCH = "shape_mismatch"
    VALUE_MISMATCH = "value_mismatch"
    DECEPTIVE = "deceptive"  # correct outputs obtained by a known reward hack (robust check)
    HARNESS_ERROR = "harness_error"  # our own fault; must stay at zero

    def __str__(self) -> str:  # so f-strings and tables show the plain value
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

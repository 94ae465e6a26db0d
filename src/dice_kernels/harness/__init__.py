"""The evaluation harness: sandboxed compile and execution of candidate kernels against KernelBench tasks,
correctness, timing, outcome taxonomy, metrics and the results store. It is the RL reward, the curation
filter and the benchmark, so nothing here trusts candidate code."""

from dice_kernels.harness.candidate import Candidate, candidate_from_text, extract_code, load_candidate
from dice_kernels.harness.config import (BuildConfig, EvalConfig, RobustConfig, SandboxConfig, SchedulerConfig,
                                         TimingConfig)
from dice_kernels.harness.outcomes import EvalResult, Outcome

__all__ = ["BuildConfig", "Candidate", "EvalConfig", "EvalResult", "Evaluator", "Outcome", "RobustConfig",
           "SandboxConfig", "SchedulerConfig", "TimingConfig", "candidate_from_text", "evaluate", "extract_code",
           "load_candidate"]


def __getattr__(name: str):
    # the evaluator and its scheduler load torch and every parent-side module: imported on first use, so a worker
    # (which imports this package for its own modules) and `dice --help` do not pay for them
    if name in ("Evaluator", "evaluate"):
        from dice_kernels.harness import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'dice_kernels.harness' has no attribute {name!r}")

"""The evaluation harness: sandboxed compile and execution of candidate kernels against KernelBench tasks,
correctness, timing, outcome taxonomy, metrics and the results store. It is the RL reward, the curation
filter and the benchmark, so nothing here trusts candidate code."""

from dice_kernels.harness.candidate import Candidate, candidate_from_text, extract_code, load_candidate
from dice_kernels.harness.config import EvalConfig
from dice_kernels.harness.outcomes import EvalResult, Outcome
from dice_kernels.harness.runner import Evaluator, evaluate

__all__ = ["Candidate", "EvalConfig", "EvalResult", "Evaluator", "Outcome", "candidate_from_text", "evaluate",
           "extract_code", "load_candidate"]

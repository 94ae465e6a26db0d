"""`EvalConfig`: every knob of one evaluation run, in one typed place (the CLI only fills it in)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


def default_cache_dir() -> Path:
    """Content-addressed build cache shared across runs: $DICE_CACHE_DIR, else ~/.cache/dice-kernels/builds."""
    env = os.environ.get("DICE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "dice-kernels" / "builds"


@dataclass
class EvalConfig:
    backend: str = "auto"  # "cuda", "cpu", or "auto" (cuda when a GPU is present)
    trials: int = 5  # correctness trials, each with freshly seeded inputs
    atol: float = 1e-2
    rtol: float = 1e-2
    seed: int = 42
    timing: bool = True  # measure candidate and reference runtime for correct candidates
    warmup: int = 3
    timing_iters: int = 30
    jobs: int = max(1, (os.cpu_count() or 2))  # parallel compiles
    run_workers: int = 0  # concurrent run workers (timing is still one at a time); 0: 1 on cpu, 4 on cuda
    cpu_threads: int = 1  # intra-op threads for CPU-backend workers (reference and candidate alike)
    compile_timeout_s: float = 600.0
    run_timeout_s: float = 300.0  # wall clock for one candidate's correctness + timing run
    memory_limit_gb: float = 32.0  # host memory per worker process (KernelBench inputs reach several GiB)
    file_limit_mb: int = 4096  # largest file a worker may write (outputs are written as files)
    cache_dir: Path = field(default_factory=default_cache_dir)
    isolate_network: bool = True
    restrict_writes: bool = True  # Landlock: a worker may write only inside its own directories

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            if self.backend not in ("cpu", "cuda"):
                raise ValueError(f"backend must be 'cpu', 'cuda' or 'auto', not {self.backend!r}")
            return self.backend
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_run_workers(self, backend: str) -> int:
        if self.run_workers > 0:
            return self.run_workers
        return 4 if backend == "cuda" else 1

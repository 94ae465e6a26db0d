"""Verification: run every pair through the evaluation harness, or mark it `unverified` when it cannot run here.

A CUDA kernel on a machine without a GPU is never guessed at: it is marked unverified with the reason, unless a
resumed build's harness database already holds its result (verified on a GPU machine, curated on another).
Everything else is handed to `dice_kernels.harness.evaluate` in one batch (correctness trials, robust check, timing).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Callable

from dice_kernels.data.records import FAILED, UNVERIFIED, VERIFIED, PairRecord, Verification
from dice_kernels.harness.compiling.cache import cuda_marker

STAGE = "verify"
# A kernel program must build an extension; one that never does is PyTorch rewritten, not a kernel pair.
_EXTENSION_RE = re.compile(r"\bload_inline\s*\(|cpp_extension\.load\s*\(|\bload\s*\(\s*name\s*=")


def from_eval_result(result) -> Verification:
    """Map a harness `EvalResult` to a `Verification` (verified only when correct and not deceptive)."""
    outcome = str(result.outcome)
    common = dict(outcome=outcome, correct=bool(result.correct), deceptive_kind=result.deceptive_kind,
                  speedup=result.speedup, ref_time_ms=result.ref_time_ms, cand_time_ms=result.cand_time_ms,
                  backend=result.backend, hardware=result.hardware)
    if outcome == "correct" and result.correct:
        speed = f", speedup {result.speedup:.2f}x" if result.speedup is not None else ", not timed"
        return Verification(VERIFIED, f"correct on {result.trials_passed}/{result.correctness_trials} trials"
                            f"{speed}", **common)
    if outcome == "deceptive":
        return Verification(FAILED, f"deceptive ({result.deceptive_kind or 'unspecified'}): {result.error}"[:500],
                            **common)
    return Verification(FAILED, f"{outcome}: {result.error}"[:500], **common)


def verify(records: list[PairRecord], config, out_dir: Path | None = None, resume: bool = False,
           progress: bool = True, evaluate: Callable | None = None) -> list[Verification]:
    """One `Verification` per record, same order. `config` is a harness `EvalConfig`.

    `evaluate` defaults to `dice_kernels.harness.evaluate`; it is only imported when some pair can run here.
    """
    from dice_kernels.harness.candidate import Candidate
    from dice_kernels.tasks import TaskError, task_from_code

    backend = config.resolved_backend()
    results: list[Verification | None] = [None] * len(records)
    recorded = _recorded_results(out_dir) if out_dir is not None and resume else {}
    runnable = []
    for i, r in enumerate(records):
        marker = cuda_marker(r.kernel)
        sha = hashlib.sha256(r.kernel.encode()).hexdigest()
        if (r.id, r.id, sha) in recorded:  # this exact pair was evaluated before, maybe on another machine
            results[i] = from_eval_result(recorded[(r.id, r.id, sha)])
        elif not r.kernel.strip():
            results[i] = Verification(UNVERIFIED, "no kernel program to verify", backend=backend)
        elif not _EXTENSION_RE.search(r.kernel):
            results[i] = Verification(FAILED, "no custom kernel: the program never builds an extension "
                                      "(load_inline / cpp_extension.load)", backend=backend)
        elif marker and backend != "cuda":
            results[i] = Verification(UNVERIFIED, f"CUDA kernel ({marker}) and the backend is {backend}: "
                                      "needs a GPU, not run", backend=backend)
        else:
            try:
                task = task_from_code(r.reference, id=r.id, level=r.level, source=r.source)
            except TaskError as e:
                results[i] = Verification(FAILED, f"reference is not a usable task: {e}", backend=backend)
                continue
            candidate = Candidate(id=r.id, code=r.kernel, raw_sha256=sha)
            runnable.append((i, task, candidate))
    if runnable:
        if evaluate is None:
            from dice_kernels.harness import evaluate
        evals = evaluate([(t, c) for _, t, c in runnable], config, out_dir=out_dir, resume=resume,
                         progress=progress)
        if len(evals) != len(runnable):
            raise RuntimeError(f"harness returned {len(evals)} results for {len(runnable)} pairs")
        for (i, _, _), res in zip(runnable, evals):
            results[i] = from_eval_result(res)
    return results  # type: ignore[return-value]  # every slot is filled above


def _recorded_results(out_dir: Path) -> dict:
    """Results already in the build's harness database, as `evaluate(resume=True)` keeps them."""
    path = Path(out_dir) / "results.sqlite"
    if not path.exists():
        return {}
    from dice_kernels.harness.store import ResultStore

    store = ResultStore(path)
    try:
        return store.finished()
    finally:
        store.close()

"""Shared test fixtures: the build cache shared by every test in a session, and the shared/ data folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
EXAMPLES = REPO / "src" / "dice_kernels" / "examples"


def _one_share_of_the_cpus_per_worker() -> None:
    """Under pytest-xdist, each worker's torch (and every process a test starts, which inherits the environment)
    gets its share of the CPUs as intra-op threads: the README's `-n 2` on 2 cores gives 1 each. torch's default, one
    thread per core in every process, had the two workers' OpenMP threads spin against each other and against the
    compiles beside them: in the suite, the rl_learning_probe smoke took 72 s (10 s alone), test_sampling.py 94 s
    (25 s at 1 thread). The harness's workers are unaffected: they run with `scheduler.cpu_threads` (default 1).
    An OMP_NUM_THREADS set by the caller is kept."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cpus // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # imported before this file: its thread pool exists already
        sys.modules["torch"].set_num_threads(threads)


_one_share_of_the_cpus_per_worker()


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def build_cache(tmp_path_factory) -> Path:
    """One build cache for the whole session, so each distinct extension compiles once. Under pytest-xdist (the
    README's `-n 2`) the workers share it, as a trainer's reward service and a `dice eval` run share one: the cache
    is safe across processes, and a second worker finds the extensions the first built, and waits for a precompiled
    header the first is building instead of compiling its own (`compiling/speed.py`, `pch_lock`)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "build-cache"  # the run's folder above each worker's
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("build-cache")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present (a fresh clone has no shared/)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def example_pairs():
    """The shipped example (task, candidate) pairs of one backend, candidate ids like "19_ReLU/correct"."""
    from dice_kernels.harness import load_candidate
    from dice_kernels.tasks import load_tasks

    def pairs(backend: str) -> list:
        tasks = {t.name: t for t in load_tasks(EXAMPLES / "tasks")}
        root = EXAMPLES / "solutions" / backend / "level1"
        return [(tasks[p.parent.name], load_candidate(p, id=f"{p.parent.name}/{p.stem}"))
                for p in sorted(root.rglob("*.py"))]

    return pairs

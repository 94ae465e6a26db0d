"""The worker protocol: the job the parent writes for one worker, imported by both sides. A `BuildJob` builds a
candidate's extensions into the build cache; a `RunJob` runs the task's `Model` (its `reference` part set) or a
candidate's `ModelNew` (its `candidate` part set) on seeded inputs. Jobs travel as JSON in the worker's private
directory, which the worker deletes before it reads untrusted code."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class BuildJob:
    workdir: str
    device: str
    limits: dict  # sandbox.Limits' fields
    candidate_path: str
    build_dir: str  # the staging directory the build writes into (published into the cache when it succeeds)
    # build_speed.BuildAcceleration.for_job(): precompiled headers by json(extra_cflags), while some header is
    # being built the compiler that builds it, and whether CUDA sources try lighter torch headers first
    pch: dict = field(default_factory=dict)
    pch_light: dict = field(default_factory=dict)
    pch_bare: dict = field(default_factory=dict)  # the bare build's stub header (bare_cpp.py), published with its PCH
    torch_macros: str | None = None  # speed.torch_macros_file: torch's macro names, once the parent has stored them
    cuda_surroundings: str | None = None  # bare_cuda.surroundings_file, once the parent has stored it
    pch_compiler: str | None = None
    light_headers: bool = False


@dataclass(frozen=True)
class ReferencePart:
    """What only a reference run does."""

    # the parent has this task's baseline (harness/timing/baselines.py), so nothing is timed; the worker still computes
    # the trials and the re-checked call's outputs, which are never cached
    baseline_cached: bool = False
    compile_baseline: bool = False  # also time torch.compile(Model) with the same protocol
    # report the task's speed-of-light inputs (FLOPs, minimum bytes moved) and measure the device's ceilings for
    # the task's dtype unless the parent already has them (the dtypes it has)
    speed_of_light: bool = False
    ceilings_known: tuple[str, ...] = ()


@dataclass(frozen=True)
class CandidatePart:
    """What only a candidate run does. After its trials it waits for the parent's verdict on their outputs: only
    a candidate whose trials are right is timed and profiled."""

    candidate_path: str
    build_dir: str | None  # its build in the cache (read-only to the run)
    # the robust check (integrity.Monitor), or None when it is off
    allowed_ops: tuple[str, ...] | None = None
    min_extension_gpu_share: float = 0.0
    min_replaced_ops_share: float = 0.0
    min_partial_gpu_share: float = 0.0


@dataclass(frozen=True)
class RunJob:
    workdir: str
    device: str
    limits: dict  # sandbox.Limits' fields
    task_path: str
    seed: int
    trials: int  # correctness trials, the hardened ones included
    atol: float  # the reference's degenerate-task check (does an input copy pass?) and its stateful check
    rtol: float
    timing: bool
    timing_plan: dict  # timing.TimingPlan's fields
    gpu_lock: str | None = None  # gpu_lock.create prefix: correctness calls share the device, timing has it alone
    inputs_on_device: bool = False  # call get_inputs() with the device as torch's default device
    reference: ReferencePart | None = None
    candidate: CandidatePart | None = None
    # the last len(hardened) trials run on trial_inputs.harden(inputs, variant) for these variants: a reference
    # runs them all, a candidate the ones that decide its degenerate task (degenerate.breaking_trials)
    hardened: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if (self.reference is None) == (self.candidate is None):
            raise ValueError("a RunJob runs either the reference or a candidate")
        if len(self.hardened) > self.trials:
            raise ValueError("more hardened trials than trials")

    @property
    def usual_trials(self) -> int:
        """The trials on the task's own inputs (seeds `seed + 1 + k`); the seeds after them are the timing's, the
        same for a reference and a candidate whatever hardened trials each runs."""
        return self.trials - len(self.hardened)


Job = BuildJob | RunJob


def write_job(job: Job, path: Path) -> None:
    path.write_text(json.dumps({"mode": "build" if isinstance(job, BuildJob) else "run", **asdict(job)}))


def read_job(path: str | Path) -> Job:
    raw = json.loads(Path(path).read_text())
    if raw.pop("mode") == "build":
        return BuildJob(**raw)
    ref, cand = raw.pop("reference"), raw.pop("candidate")
    raw["hardened"] = tuple(raw.get("hardened", ()))
    return RunJob(**raw, reference=ReferencePart(**{**ref, "ceilings_known": tuple(ref["ceilings_known"])})
                  if ref else None,
                  candidate=CandidatePart(**{**cand, "allowed_ops": tuple(cand["allowed_ops"])
                                             if cand["allowed_ops"] is not None else None}) if cand else None)

"""The harness's command-line options, one set shared by every command that evaluates (`dice eval`, `dice data
build`): each flag is its `EvalConfig` field's name (`--run-timeout-s` sets `run_timeout_s`), its default the
field's default, so a knob has one name and one default from the command line to the worker. `@eval_options`
adds them to a typer command, which receives the checked `EvalConfig` as `eval_config`; a value with no meaning
is one line naming its flag (exit code 2)."""

from __future__ import annotations

import functools
import inspect
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Callable, Optional

import typer

from dice_kernels.cli_errors import fail
from dice_kernels.harness.config import EvalConfig

_FIELDS = {f.name: f for f in fields(EvalConfig)}

# field -> help; the flag is --field-name, a bool is --x/--no-x, the default EvalConfig's
HELP = {
    "backend": "cuda | cpu | auto (cuda when a GPU is present). CPU candidates are C++ extensions.",
    "trials": "Correctness trials, each with freshly seeded inputs.",
    "atol": "Absolute tolerance.",
    "rtol": "Relative tolerance.",
    "timing": "Time correct candidates and references.",
    "timing_iters": "Least timed calls per model; more follow until the median's 95% CI is within "
                    "--timing-target-ci of it (docs/timing.md).",
    "timing_max_s": "Most seconds of timed calls per model.",
    "timing_target_ci": "Timing stops once the median's 95% interval is within this fraction of it.",
    "timing_loops": "Independent timing loops per model, sharing the limits above; the time is the mean of their "
                    "medians (docs/timing.md).",
    "inputs_on_device": "CUDA: run the task's get_inputs() with the GPU as default device (no CPU generation and "
                        "copy of multi-GiB inputs); --no-inputs-on-device generates them on the CPU, as KernelBench.",
    "run_timeout_s": "Wall-clock seconds for one candidate's run, or --run-timeout-reference-factor times its "
                     "task's reference run when that is longer.",
    "run_timeout_reference_factor": "See --run-timeout-s (tasks whose reference needs minutes).",
    "compile_timeout_s": "Wall-clock seconds for one candidate's build.",
    "memory_limit_gb": "Host memory limit per worker, GiB (and the most one trial's outputs may take); default: "
                       "32, at most half of this machine's memory.",
    "output_memory_gb": "Host memory, GiB, this process may hold for tasks' outputs (a task's reference trials and "
                        "its candidates' frames in flight); a task that does not fit beside the others waits its "
                        "turn. 0: half of what is available at the start.",
    "cache_dir": "Build cache, shared across runs (default $DICE_CACHE_DIR or ~/.cache/dice-kernels/builds).",
    "compile_baseline": "Also time torch.compile(Model) per task and report speedups and fast_p against it "
                        "(compiling costs seconds to minutes per task).",
    "speed_of_light": "cuda | always | off. Quarantine a speedup whose time beats the task's speed-of-light bound "
                      "(minimum bytes moved at the measured memory bandwidth): it keeps its outcome, gets no speedup "
                      "and the flag faster_than_light; beating the reference's FLOPs at the measured peak only adds "
                      "the flag fewer_flops_than_reference. 'cuda': on the CUDA backend only (docs/timing.md).",
    "baselines": "reuse | fresh | off. Reference timings and speed-of-light inputs are cached per task, machine, "
                 "torch version and timing settings in the cache folder's baselines.sqlite: 'reuse' a cached one "
                 "(the reference still runs for its outputs, untimed), 'fresh' measures again and replaces it, "
                 "'off' measures and caches nothing.",
    "fast_build": "Precompiled torch/extension.h for C++ units, lighter headers for CUDA units first (falls back to "
                  "the candidate's own sources; docs/harness.md).",
    "robust": "Run the robust check: correct candidates caught by an integrity check become `deceptive` "
              "(docs/robust_check.md).",
    "jobs": "Builds in flight (default: 1.25 per CPU core; a build waiting for the precompiled header compiles "
            "only its CUDA unit).",
    "run_workers": "Concurrent run workers (a timing loop has the device to itself); 0: 1 on cpu; on cuda 4, or 8 "
                   "on a GPU with 128 GiB or more.",
    "warm_workers": "Worker processes started ahead of their job (each still runs one job); -1: as many as run "
                    "workers, 0: none.",
    "warm_build_workers": "Build workers started ahead of their job likewise, for the builds after the first "
                          "--jobs; 0: none.",
    "fork_workers": "Fork each worker from a process that imported torch once, instead of starting an interpreter "
                    "that imports it (each is still a fresh process; docs/harness.md).",
}
_SHORT = {"jobs": ["-j"]}


def _option(name: str) -> tuple[object, object]:
    """(annotation, typer.Option) of one field's flag."""
    f = _FIELDS[name]
    default = f.default if f.default is not MISSING else f.default_factory()
    flag = "--" + name.replace("_", "-")
    if name == "cache_dir":  # resolved from the environment when not given
        return Optional[Path], typer.Option(None, flag, help=HELP[name])
    if name == "jobs":  # machine-dependent: 0 keeps EvalConfig's
        return int, typer.Option(0, flag, *_SHORT[name], help=HELP[name])
    if isinstance(default, bool):
        return bool, typer.Option(default, f"{flag}/--no-{flag[2:]}", help=HELP[name])
    return type(default), typer.Option(default, flag, help=HELP[name])


def eval_options(command: Callable) -> Callable:
    """Add the harness's options to a typer command that takes `eval_config: EvalConfig` (and `allow_op`, the
    allow-list's additions); a setting that has no meaning is a clear error naming its flag."""
    signature = inspect.signature(command)
    own = [p for p in signature.parameters.values() if p.name != "eval_config"]
    added = []
    for name in HELP:
        annotation, option = _option(name)
        added.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation))
    added.append(inspect.Parameter(
        "allow_op", inspect.Parameter.KEYWORD_ONLY, annotation=list[str],
        default=typer.Option([], "--allow-op",
                             help="An ATen op forward may dispatch without counting as a PyTorch fallback, e.g. "
                                  "aten::mm (repeatable; added to the default allow-list).")))

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        values = {name: kwargs.pop(name) for name in HELP}
        kwargs["eval_config"] = config_from(values, kwargs.pop("allow_op"))
        return command(*args, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*own, *added])
    wrapper.__annotations__ = {**{p.name: p.annotation for p in own}, **{p.name: p.annotation for p in added}}
    del wrapper.__wrapped__  # typer reads the signature above, not the command's own
    return wrapper


def config_from(values: dict, allow_op: list[str]) -> EvalConfig:
    """The checked EvalConfig of the options' values; a value that has no meaning is one line on stderr naming its
    flag, and exit code 2."""
    bad = [op for op in allow_op if not op.startswith("aten::")]
    if bad:
        fail(f"--allow-op takes ATen op names such as aten::mm, not {', '.join(bad)}")
    if not values.get("jobs"):
        values.pop("jobs", None)
    if values.get("cache_dir") is None:
        values.pop("cache_dir", None)
    try:
        config = EvalConfig(**values, allowed_ops=(*_FIELDS["allowed_ops"].default, *allow_op))
        config.check()
    except (ValueError, TypeError) as e:
        name = str(e).split()[0]
        fail(f"--{name.replace('_', '-')} {str(e).split(' ', 1)[1]}" if name in _FIELDS else str(e))
    return config


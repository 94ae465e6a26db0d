"""The harness's command-line options, one set shared by every command that evaluates (`dice eval`, `dice data
build`): each flag is its `EvalConfig` setting's dotted path (`--timing-iters` sets `timing.iters`,
`--sandbox-run-timeout-s` sets `sandbox.run_timeout_s`; a section's `enabled` switch is `--timing/--no-timing`), its
default the field's default, so a knob has one name and one default from the command line to the worker.
`@eval_options` adds them to a typer command, which receives the checked `EvalConfig` as `eval_config`; a value with
no meaning is one line naming its flag (exit code 2)."""

from __future__ import annotations

import functools
import inspect
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Callable, Optional

import typer

from dice_kernels.cli_errors import fail
from dice_kernels.harness.config import SECTIONS, EvalConfig

# setting (dotted path) -> help; the flag is --section-field-name, a bool is --x/--no-x, the default the field's
HELP = {
    "backend": "cuda | cpu | auto (cuda when a GPU is present). CPU candidates are C++ extensions.",
    "trials": "Correctness trials, each with freshly seeded inputs.",
    "atol": "Absolute tolerance.",
    "rtol": "Relative tolerance.",
    "inputs_on_device": "CUDA: run the task's get_inputs() with the GPU as default device (no CPU generation and "
                        "copy of multi-GiB inputs); --no-inputs-on-device generates them on the CPU, as KernelBench.",
    "cache_dir": "Build cache, shared across runs (default $DICE_CACHE_DIR or ~/.cache/dice-kernels/builds).",
    "reuse_verdicts": "Give a program evaluated before (same task, syntax tree, verdict-deciding settings, machine, "
                      "torch and harness) that verdict, timing included, without running it again (the cache "
                      "folder's verdicts.sqlite), and compare a new program with its task's reference outputs an "
                      "earlier batch of this process kept in memory (docs/harness.md).",
    "timing.enabled": "Time correct candidates and references.",
    "timing.iters": "Least timed calls per model; more follow until the median's 95% CI is within "
                    "--timing-target-ci of it (docs/timing.md).",
    "timing.max_s": "Most seconds of timed calls per model.",
    "timing.target_ci": "Timing stops once the median's 95% interval is within this fraction of it.",
    "timing.loops": "Independent timing loops per model, sharing the limits above; the time is the mean of their "
                    "medians (docs/timing.md).",
    "timing.compile_baseline": "Also time torch.compile(Model) per task and report speedups and fast_p against it "
                               "(compiling costs seconds to minutes per task).",
    "timing.speed_of_light": "cuda | always | off. Quarantine a speedup whose time beats the task's speed-of-light bound "
                             "(minimum bytes moved at the measured memory bandwidth): it keeps its outcome, gets no speedup "
                             "and the flag faster_than_light; beating the reference's FLOPs at the measured peak only adds "
                             "the flag fewer_flops_than_reference. 'cuda': on the CUDA backend only (docs/timing.md).",
    "timing.baselines": "reuse | fresh | off. Reference timings and speed-of-light inputs are cached per task, machine, "
                        "torch version and timing settings in the cache folder's baselines.sqlite: 'reuse' a cached one "
                        "(the reference still runs for its outputs, untimed), 'fresh' measures again and replaces it, "
                        "'off' measures and caches nothing.",
    "sandbox.run_timeout_s": "Wall-clock seconds for one candidate's run, or --sandbox-run-timeout-reference-factor times its "
                             "task's reference run when that is longer.",
    "sandbox.run_timeout_reference_factor": "See --sandbox-run-timeout-s (tasks whose reference needs minutes).",
    "sandbox.memory_limit_gb": "Host memory limit per worker, GiB (and the most one trial's outputs may take); default: "
                               "32, at most half of this machine's memory.",
    "build.timeout_s": "Wall-clock seconds for one candidate's build.",
    "build.fast": "Precompiled torch/extension.h for C++ units, lighter headers for CUDA units first (falls back to "
                  "the candidate's own sources; docs/harness.md).",
    "build.jobs": "Builds in flight (default: 1.25 per CPU core; a build waiting for the precompiled header compiles "
                  "only its CUDA unit).",
    "build.warm_workers": "Build workers started ahead of their job likewise, for the builds after the first "
                          "--build-jobs; 0: none.",
    "robust.enabled": "Run the robust check: correct candidates caught by an integrity check become `deceptive` "
                      "(docs/robust_check.md).",
    "robust.allow_ops": "An ATen op forward may dispatch without counting as a PyTorch fallback, e.g. aten::mm "
                        "(repeatable; added to the default allow-list).",
    "scheduler.output_memory_gb": "Host memory, GiB, this process may hold for tasks' outputs (a task's reference trials and "
                                  "its candidates' frames in flight); a task that does not fit beside the others waits its "
                                  "turn. 0: half of what is available at the start.",
    "scheduler.reference_cache_mb": "With --reuse-verdicts, keep tasks' reference outputs in memory for the later "
                                    "batches of this process, up to this many MiB in all; 0: keep none.",
    "scheduler.run_workers": "Concurrent run workers (a timing loop has the device to itself); 0: 1 on cpu; on cuda 4, or 8 "
                             "on a GPU with 128 GiB or more.",
    "scheduler.warm_workers": "Worker processes started ahead of their job (each still runs one job); -1: as many as run "
                              "workers, 0: none.",
    "scheduler.fork_workers": "Fork each worker from a process that imported torch once, instead of starting an interpreter "
                              "that imports it (each is still a fresh process; docs/harness.md).",
}
_SHORT = {"build.jobs": ["-j"]}


def flag(path: str) -> str:
    """A setting's flag: its dotted path with dashes (`timing.iters` -> `--timing-iters`); a section's `enabled`
    switch is the section's name (`--timing`)."""
    return "--" + path.removesuffix(".enabled").replace(".", "-").replace("_", "-")


def _param(path: str) -> str:
    """The flag's parameter name in the command's signature (an identifier: `timing_iters`)."""
    return flag(path)[2:].replace("-", "_")


def _default(path: str) -> object:
    section, _, name = path.rpartition(".")
    f = next(f for f in fields(SECTIONS[section] if section else EvalConfig) if f.name == name)
    return f.default if f.default is not MISSING else f.default_factory()


def _option(path: str) -> tuple[object, object]:
    """(annotation, typer.Option) of one setting's flag."""
    default, name, help = _default(path), flag(path), HELP[path]
    if path == "cache_dir":  # resolved from the environment when not given
        return Optional[Path], typer.Option(None, name, help=help)
    if path == "build.jobs":  # machine-dependent: 0 keeps BuildConfig's
        return int, typer.Option(0, name, *_SHORT[path], help=help)
    if path == "robust.allow_ops":  # repeatable
        return list[str], typer.Option([], name, help=help)
    if isinstance(default, bool):
        return bool, typer.Option(default, f"{name}/--no-{name[2:]}", help=help)
    return type(default), typer.Option(default, name, help=help)


def eval_options(command: Callable) -> Callable:
    """Add the harness's options to a typer command that takes `eval_config: EvalConfig`; a setting that has no
    meaning is a clear error naming its flag."""
    signature = inspect.signature(command)
    own = [p for p in signature.parameters.values() if p.name != "eval_config"]
    added = []
    for path in HELP:
        annotation, option = _option(path)
        added.append(inspect.Parameter(_param(path), inspect.Parameter.KEYWORD_ONLY, default=option,
                                       annotation=annotation))

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        kwargs["eval_config"] = config_from({path: kwargs.pop(_param(path)) for path in HELP})
        return command(*args, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*own, *added])
    wrapper.__annotations__ = {**{p.name: p.annotation for p in own}, **{p.name: p.annotation for p in added}}
    del wrapper.__wrapped__  # typer reads the signature above, not the command's own
    return wrapper


def config_from(values: dict[str, object]) -> EvalConfig:
    """The checked EvalConfig of the options' values (by dotted path); a value that has no meaning is one line on
    stderr naming its flag, and exit code 2."""
    if not values.get("build.jobs"):
        values.pop("build.jobs", None)
    if values.get("cache_dir") is None:
        values.pop("cache_dir", None)
    try:
        config = EvalConfig.from_settings(values)
        config.check()
    except (ValueError, TypeError) as e:
        path, _, rest = str(e).partition(" ")
        fail(f"{flag(path)} {rest}" if path in HELP else str(e))
    return config


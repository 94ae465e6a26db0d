"""Degenerate tasks: where a trivial output would pass the comparison, so `correct` proves little.

Decided per task from the reference's own outputs (and, for the input copy, the reference worker's check), never
from a list of task names. The flags are recorded on every result of the task (`extra["task_degenerate"]`) and
counted in the metrics; a candidate is not failed for a task being degenerate.
"""

from __future__ import annotations

import torch

from dice_kernels.harness import compare


def _sum(t: torch.Tensor) -> complex | float:
    if not t.numel():
        return 0.0
    return t.to(torch.complex128).sum().item() if t.is_complex() else t.double().sum().item()


def _mean_over_trials(trials: list[list[torch.Tensor]], i: int) -> complex | float:
    """Output i's mean over every trial, without stacking the trials into one more copy."""
    n = sum(trial[i].numel() for trial in trials)
    return sum(_sum(trial[i]) for trial in trials) / n if n else 0.0


def _constant_passes(trials: list[list[torch.Tensor]], value_of, atol: float, rtol: float) -> bool:
    """Would a candidate whose output i is filled with `value_of(i)` in every trial pass? Checked without
    materialising the constant outputs (one scalar per output, compared chunk by chunk)."""
    for trial in trials:
        for i, t in enumerate(trial):
            value = value_of(i)
            if t.is_floating_point() or t.is_complex():
                value = torch.tensor(value, dtype=t.dtype).item()  # the constant as the output's dtype holds it
            else:
                value = round(value.real if isinstance(value, complex) else value)
            if not compare.all_close_to(t, value, atol, rtol):
                return False
    return True


def degenerate_flags(trials: list[list[torch.Tensor]], atol: float, rtol: float,
                     input_copy_passes: bool) -> dict[str, bool]:
    """Which trivial answers pass every correctness trial: all zeros, one constant per output (its mean over the
    trials), an input returned unchanged; and whether the outputs are the same for every trial's inputs."""
    means = [_mean_over_trials(trials, i) for i in range(len(trials[0]))] if trials else []
    flags = {
        "zero_output_passes": _constant_passes(trials, lambda i: 0.0, atol, rtol),
        "constant_output_passes": _constant_passes(trials, lambda i: means[i], atol, rtol),
        "input_copy_passes": input_copy_passes,
        "output_ignores_inputs": len(trials) > 1 and compare.outputs_match(trials[1:], trials[:1] * (len(trials) - 1),
                                                                           atol, rtol),
    }
    flags["degenerate"] = any(flags.values())
    return flags

"""Degenerate tasks: where a trivial output would pass the comparison, so `correct` proves little.

Decided per task from the reference's own outputs (and, for the input copy, the reference worker's check), never
from a list of task names. The flags are recorded on every result of the task (`extra["task_degenerate"]`) and
counted in the metrics; a candidate is not failed for a task being degenerate.
"""

from __future__ import annotations

import torch

from dice_kernels.harness.compare import outputs_match


def _mean(t: torch.Tensor) -> complex | float:
    if not t.numel():
        return 0.0
    return t.to(torch.complex128).mean().item() if t.is_complex() else t.double().mean().item()


def _constant_like(t: torch.Tensor, value: complex | float) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        return torch.full_like(t, value)
    return torch.full_like(t, round(value.real if isinstance(value, complex) else value))


def degenerate_flags(trials: list[list[torch.Tensor]], atol: float, rtol: float,
                     input_copy_passes: bool) -> dict[str, bool]:
    """Which trivial answers pass every correctness trial: all zeros, one constant per output (its mean over the
    trials), an input returned unchanged; and whether the outputs are the same for every trial's inputs."""
    zeros = [[torch.zeros_like(t) for t in trial] for trial in trials]
    means = [_mean(torch.stack([trial[i] for trial in trials])) for i in range(len(trials[0]))] if trials else []
    constants = [[_constant_like(t, means[i]) for i, t in enumerate(trial)] for trial in trials]
    flags = {
        "zero_output_passes": outputs_match(trials, zeros, atol, rtol),
        "constant_output_passes": outputs_match(trials, constants, atol, rtol),
        "input_copy_passes": input_copy_passes,
        "output_ignores_inputs": len(trials) > 1 and outputs_match(trials[1:], trials[:1] * (len(trials) - 1), atol, rtol),
    }
    flags["degenerate"] = any(flags.values())
    return flags

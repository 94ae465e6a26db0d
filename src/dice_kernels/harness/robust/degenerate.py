"""Degenerate tasks: where a trivial output would pass the comparison, so `correct` proves little.

Decided per task from the reference's own outputs (and, for the input copy, the reference worker's check), never
from a list of task names. The flags are recorded on every result of the task (`EvalResult.task_flags.degenerate`) and
counted in the metrics. A candidate is not failed for its task being degenerate, but on such a task it must also
match the reference on hardened inputs where no trivial answer passes (`breaking_trials`).
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


def _finite(outs: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in outs if t.is_floating_point() or t.is_complex())


def breaking_trials(trials: list[list[torch.Tensor]], hardened: list[list[torch.Tensor]], flags: dict[str, bool],
                    copy_passes: list[bool], atol: float, rtol: float) -> list[tuple[int, list[torch.Tensor]]]:
    """The hardened trials (trial_inputs.harden; variant, reference outputs) that decide a degenerate task: the
    reference ran and gave finite outputs of the usual count, and none of the trivial answers that pass its own
    trials (zeros, its constant, an input copy, its first trial's outputs again) passes there. Empty for a task
    that is not degenerate: its own trials decide."""
    if not flags.get("degenerate") or not trials:
        return []
    means = [_mean_over_trials(trials, i) for i in range(len(trials[0]))]
    kept = []
    for variant, outs in enumerate(hardened):
        if len(outs) != len(trials[0]) or not _finite(outs):
            continue
        if flags["zero_output_passes"] and _constant_passes([outs], lambda i: 0.0, atol, rtol):
            continue
        if flags["constant_output_passes"] and _constant_passes([outs], lambda i: means[i], atol, rtol):
            continue
        if flags["input_copy_passes"] and (variant >= len(copy_passes) or copy_passes[variant]):
            continue
        if flags["output_ignores_inputs"] and compare.outputs_match([trials[0]], [outs], atol, rtol):
            continue
        kept.append((variant, outs))
    return kept

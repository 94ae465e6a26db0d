"""Output comparison, done in the trusted parent: shapes first, then values under atol/rtol."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dice_kernels.harness.outcomes import Outcome


@dataclass(frozen=True)
class Comparison:
    outcome: Outcome  # CORRECT, SHAPE_MISMATCH or VALUE_MISMATCH
    trials_passed: int
    max_abs_diff: float | None
    message: str = ""


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    wide = torch.complex128 if a.is_complex() else torch.float64
    a, b = a.to(wide), b.to(wide)
    diff = (a - b).abs()
    both_nan = torch.isnan(a) & torch.isnan(b)
    diff = torch.where(both_nan, torch.zeros_like(diff), diff)
    return float(torch.nan_to_num(diff, nan=float("inf")).max())


def compare_trials(reference: list[list[torch.Tensor]], candidate: list[list[torch.Tensor]],
                   atol: float, rtol: float) -> Comparison:
    """Every trial's outputs must match in count, shape and value (NaN matches only NaN)."""
    if len(candidate) != len(reference):
        return Comparison(Outcome.VALUE_MISMATCH, 0, None,
                          f"candidate produced {len(candidate)} trials, reference {len(reference)}")
    passed, worst = 0, 0.0
    for trial, (ref_outs, cand_outs) in enumerate(zip(reference, candidate)):
        if len(ref_outs) != len(cand_outs):
            return Comparison(Outcome.SHAPE_MISMATCH, passed, None,
                              f"trial {trial}: forward returned {len(cand_outs)} tensors, expected {len(ref_outs)}")
        for i, (r, c) in enumerate(zip(ref_outs, cand_outs)):
            if tuple(r.shape) != tuple(c.shape):
                return Comparison(Outcome.SHAPE_MISMATCH, passed, None,
                                  f"trial {trial}, output {i}: shape {tuple(c.shape)}, expected {tuple(r.shape)}")
        trial_ok = True
        for i, (r, c) in enumerate(zip(ref_outs, cand_outs)):
            if c.is_complex() != r.is_complex():
                return Comparison(Outcome.VALUE_MISMATCH, passed, None,
                                  f"trial {trial}, output {i}: dtype {c.dtype}, expected {r.dtype}")
            rr, cc = (r, c) if r.is_complex() else (r.double(), c.double())
            ok = torch.allclose(cc, rr, atol=atol, rtol=rtol, equal_nan=True)
            worst = max(worst, _max_abs_diff(r, c))
            if not ok:
                trial_ok = False
        if not trial_ok:
            return Comparison(Outcome.VALUE_MISMATCH, passed, worst,
                              f"trial {trial}: values differ (max abs diff {worst:.3g}, atol={atol}, rtol={rtol})")
        passed += 1
    return Comparison(Outcome.CORRECT, passed, worst)

"""robust/output_checks.py's value comparison: what counts as an input left unchanged, or an output finished."""

from __future__ import annotations

import torch

from dice_kernels.harness.robust.output_checks import _same_values


def test_same_values_matches_nan_with_nan_and_nothing_else():
    a = torch.tensor([1.0, float("nan"), -0.0])
    assert _same_values(a, a.clone())
    assert _same_values(a, torch.tensor([1.0, float("nan"), 0.0]))  # -0.0 == 0.0, as values
    assert not _same_values(a, torch.tensor([1.0, 2.0, 0.0]))  # a NaN written over
    assert not _same_values(torch.tensor([1.0, 2.0, 0.0]), a)
    assert not _same_values(a, torch.tensor([1.5, float("nan"), 0.0]))
    assert not _same_values(a, a.double())  # another dtype
    assert not _same_values(a, a[:2])  # another shape
    ints = torch.arange(6)
    assert _same_values(ints, ints.clone()) and not _same_values(ints, ints.flip(0))

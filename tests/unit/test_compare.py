"""Output comparison in bounded memory (harness/compare.py, degenerate.py): comparing chunk by chunk gives the
same verdicts, differences and degenerate-task flags as comparing whole tensors."""

import pytest
import torch

from dice_kernels.harness import compare
from dice_kernels.harness.robust.degenerate import degenerate_flags
from dice_kernels.harness.outcomes import Outcome


def _pair():
    ref = torch.linspace(-1, 1, 50)
    ref[30] = float("nan")
    cand = ref.clone()
    cand[45] += 0.5  # the only difference, in the last of several chunks
    return ref, cand


@pytest.mark.parametrize("chunk", [7, 1 << 24])
def test_chunked_comparison_finds_a_difference_in_any_chunk(monkeypatch, chunk):
    monkeypatch.setattr(compare, "CHUNK", chunk)
    ref, cand = _pair()
    cmp = compare.compare_trials([[ref]], [[cand]], 1e-2, 1e-2)
    assert cmp.outcome is Outcome.VALUE_MISMATCH and cmp.max_abs_diff == pytest.approx(0.5)
    assert compare.outputs_match([[ref]], [[ref.clone()]], 1e-2, 1e-2)  # NaN matches NaN, in its own chunk
    poisoned = ref.clone()
    poisoned[40:50] = float("nan")  # never written: the poison left in freed memory
    assert compare._unwritten([ref], [poisoned], 1e-2, 1e-2) == 10


@pytest.mark.parametrize("chunk", [5, 1 << 24])
def test_degenerate_flags_do_not_depend_on_the_chunk(monkeypatch, chunk):
    monkeypatch.setattr(compare, "CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    near_constant = [[torch.full((33,), 0.5) + torch.rand(33, generator=g) * 1e-3] for _ in range(5)]
    varied = [[torch.randn(33, generator=g)] for _ in range(5)]
    zeros = [[torch.zeros(4, 9)] for _ in range(3)]
    assert degenerate_flags(near_constant, 1e-2, 1e-2, False) == {
        "zero_output_passes": False, "constant_output_passes": True, "input_copy_passes": False,
        "output_ignores_inputs": True, "degenerate": True}
    assert not degenerate_flags(varied, 1e-2, 1e-2, False)["degenerate"]
    assert degenerate_flags(zeros, 1e-2, 1e-2, False)["zero_output_passes"]


def test_short_path_agrees_with_allclose_on_every_chunk_kind(monkeypatch):
    """Finite chunks take the short path, chunks holding NaN or infinity allclose itself: the verdict and the
    largest difference must be allclose's either way, including right at the tolerance's edge."""
    monkeypatch.setattr(compare, "CHUNK", 16)
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(160, generator=g, dtype=torch.float64)
    tol = 1e-2 + 1e-2 * ref.abs()
    cases = {"inside the edge": ref + tol * 0.999, "outside the edge": ref + tol * 1.001}
    nan_inf = ref.clone()
    nan_inf[[3, 40]] = float("nan")
    nan_inf[[70, 71]] = float("inf")
    cases["NaN and inf in both"] = nan_inf
    for name, cand in cases.items():
        r = nan_inf if name == "NaN and inf in both" else ref
        close, worst = compare._close_and_max_diff(r, cand, 1e-2, 1e-2)
        assert close == torch.allclose(cand, r, atol=1e-2, rtol=1e-2, equal_nan=True), name
        finite = torch.isfinite(r) & torch.isfinite(cand)
        assert worst == pytest.approx(float((cand - r)[finite].abs().max())), name
    inf_vs_number = ref.clone()
    inf_vs_number[100] = float("inf")
    assert compare._close_and_max_diff(ref, inf_vs_number, 1e-2, 1e-2) == (False, float("inf"))

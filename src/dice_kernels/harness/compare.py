"""Output comparison, done in the trusted parent: shapes first, then values under atol/rtol; and the robust
check's parent-side evidence (a failure that is the signature of caching or of stale memory)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dice_kernels.harness.outcomes import DeceptiveKind, Outcome


@dataclass(frozen=True)
class Comparison:
    outcome: Outcome  # CORRECT, SHAPE_MISMATCH or VALUE_MISMATCH
    trials_passed: int
    max_abs_diff: float | None
    message: str = ""


# elements compared at a time: a chunk's float64 temporaries (2 MiB each) stay in cache however large the outputs;
# on the 2-core machine this compares 8x faster than 16 M-element chunks (multi-GiB outputs took minutes)
CHUNK = 1 << 18


def _widened(t: torch.Tensor, wide: torch.dtype):
    """Flat slices of `t`, `CHUNK` elements each, converted to `wide` one at a time."""
    flat = t.reshape(-1)
    for i in range(0, flat.numel(), CHUNK):
        yield flat[i:i + CHUNK].to(wide)


def _chunks(a: torch.Tensor, b: torch.Tensor):
    """Aligned flat slices of two same-shape tensors, widened (float64, complex128) one chunk at a time."""
    wide = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
    return zip(_widened(a, wide), _widened(b, wide))


def all_close_to(t: torch.Tensor, value: complex | float, atol: float, rtol: float) -> bool:
    """Would a tensor of `t`'s shape filled with `value` match `t` as a candidate against it (|value - t| <= atol +
    rtol * |t|, NaN never matching a number)? Checked chunk by chunk, never materialising the constant tensor."""
    wide = torch.complex128 if t.is_complex() or isinstance(value, complex) else torch.float64
    for x in _widened(t, wide):
        diff = (x - value).abs()
        if diff.numel() and not math.isfinite(float(diff.max())):  # NaN or infinity: allclose's own rules
            if not torch.allclose(torch.full_like(x, value), x, atol=atol, rtol=rtol, equal_nan=True):
                return False
        elif not _within(diff, x, atol, rtol):
            return False
    return True


def _within(diff: torch.Tensor, other: torch.Tensor, atol: float, rtol: float) -> bool:
    """allclose's inequality |input - other| <= atol + rtol * |other|, given the finite |input - other|."""
    return bool((diff <= other.abs().mul_(rtol).add_(atol)).all())


def _close_and_max_diff(ref: torch.Tensor, cand: torch.Tensor, atol: float, rtol: float) -> tuple[bool, float]:
    """(`torch.allclose(cand, ref, equal_nan=True)`, the largest |cand - ref| with NaN against NaN and an infinity
    against the same one counting 0, NaN against a number infinite), in float64 (complex128), one pass chunk by
    chunk. A chunk whose differences are all finite (nearly every chunk) takes the short path: |cand - ref| <=
    atol + rtol * |ref| is allclose's own test once NaN and infinity are ruled out."""
    close, worst = True, 0.0
    for x, y in _chunks(ref, cand):
        diff = (x - y).abs()
        largest = float(diff.max()) if diff.numel() else 0.0
        if math.isfinite(largest):
            close = close and _within(diff, x, atol, rtol)
            worst = max(worst, largest)
            continue
        close = close and torch.allclose(y, x, atol=atol, rtol=rtol, equal_nan=True)
        diff[(torch.isnan(x) & torch.isnan(y)) | (x == y)] = 0.0
        worst = max(worst, float(torch.nan_to_num(diff, nan=float("inf"), posinf=float("inf")).max()))
    return close, worst


def exact_constant(t: torch.Tensor) -> float | None:
    """The value every element of `t` holds, exactly, or None (NaN and complex outputs are never constant)."""
    if t.is_complex() or not t.numel():
        return None
    low, high = t.min(), t.max()  # reductions: no copy of a large output
    return float(low) if bool(low == high) else None


class TrivialAnswer:
    """Fed one call's outputs at a time: is every output of every call exactly zero (`zero`), or one constant,
    the same in every call (`constant`)?"""

    def __init__(self) -> None:
        self.zero = self.constant = True
        self._values: dict[int, float] = {}

    def add(self, outs: list[torch.Tensor]) -> None:
        for i, t in enumerate(outs):
            if not t.numel():
                continue
            if self.zero and bool(t.count_nonzero()):
                self.zero = False
            if self.constant:
                value = exact_constant(t)
                if value is None or self._values.setdefault(i, value) != value:
                    self.constant = False


class TrialJudge:
    """`compare_trials` one trial at a time, as a candidate's outputs arrive: each trial is compared and dropped,
    except the first failing one (`failing`, which the robust check reads), so the parent never holds more than
    two trials of a candidate however large its outputs."""

    def __init__(self, reference: list[list[torch.Tensor]], atol: float, rtol: float, usual: int | None = None):
        self.reference, self.atol, self.rtol = reference, atol, rtol
        self.usual = len(reference) if usual is None else usual  # trials from here on are hardened ones
        self.received, self.passed, self.worst = 0, 0, 0.0
        self.failed: Comparison | None = None
        self.failing: list[torch.Tensor] | None = None
        self.trivial = TrivialAnswer()  # what a degenerate task would pay for nothing (score.robust_check)

    def add(self, cand_outs: list[torch.Tensor]) -> None:
        trial = self.received
        self.received += 1
        self.trivial.add(cand_outs)
        if self.failed is not None or trial >= len(self.reference):
            return
        self.failed = self._judge(trial, self.reference[trial], cand_outs)
        if self.failed is None:
            self.passed += 1
        else:
            self.failing = cand_outs

    def _judge(self, index: int, ref_outs: list[torch.Tensor], cand_outs: list[torch.Tensor]) -> Comparison | None:
        passed = self.passed
        trial = index if index < self.usual else (f"{index} (hardened inputs, which decide this degenerate task: "
                                                  "trivial answers pass its own)")
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
            ok, diff = _close_and_max_diff(r, c, self.atol, self.rtol)
            self.worst = max(self.worst, diff)
            trial_ok = trial_ok and ok
        if not trial_ok:
            return Comparison(Outcome.VALUE_MISMATCH, passed, self.worst, f"trial {trial}: values differ (max abs "
                              f"diff {self.worst:.3g}, atol={self.atol}, rtol={self.rtol})")
        return None

    def comparison(self) -> Comparison:
        """The verdict on every trial received: as `compare_trials` on them all."""
        if self.received != len(self.reference):
            return Comparison(Outcome.VALUE_MISMATCH, 0, None,
                              f"candidate produced {self.received} trials, reference {len(self.reference)}")
        return self.failed or Comparison(Outcome.CORRECT, self.passed, self.worst)


def compare_trials(reference: list[list[torch.Tensor]], candidate: list[list[torch.Tensor]],
                   atol: float, rtol: float) -> Comparison:
    """Every trial's outputs must match in count, shape and value (NaN matches only NaN)."""
    judge = TrialJudge(reference, atol, rtol)
    for outs in candidate:
        judge.add(outs)
    return judge.comparison()


def outputs_match(reference: list[list[torch.Tensor]], candidate: list[list[torch.Tensor]], atol: float,
                  rtol: float) -> bool:
    """Would `candidate` (per-trial outputs) be judged correct against `reference`?"""
    return compare_trials(reference, candidate, atol, rtol).outcome is Outcome.CORRECT


def _unwritten(expected: list[torch.Tensor], got: list[torch.Tensor], atol: float, rtol: float) -> int:
    """How many differing elements hold NaN (the poison of freed memory) where the reference does not; 0 unless
    they are nearly all of the differences (the allocator's own bookkeeping overwrites a few words of a free
    block)."""
    poisoned = differing = 0
    for r, c in zip(expected, got):
        if r.shape != c.shape or r.is_complex() or c.is_complex() or not c.is_floating_point():
            return 0
        for rr, cc in _chunks(r, c):
            bad = ~torch.isclose(cc, rr, atol=atol, rtol=rtol, equal_nan=True)
            differing += int(bad.sum())
            poisoned += int((bad & torch.isnan(cc) & ~torch.isnan(rr)).sum())
    return poisoned if poisoned >= 0.99 * differing else 0


def explain_mismatch(earlier: list[list[torch.Tensor]], expected: list[torch.Tensor], got: list[torch.Tensor],
                     atol: float, rtol: float, where: str) -> tuple[DeceptiveKind, str] | None:
    """Why a candidate that passed the calls with reference outputs `earlier` fails this one, when the failure is
    the signature of a known hack: an earlier call's outputs returned again, or output elements never written.
    All zeros or one constant that passed earlier calls is named for itself: a trivial answer those calls'
    outputs sat within the tolerance of (a degenerate task), not a replay."""
    for j, previous in enumerate(earlier):
        if outputs_match([previous], [got], atol, rtol) and not outputs_match([previous], [expected], atol, rtol):
            trivial = TrivialAnswer()
            trivial.add(got)
            if trivial.zero or trivial.constant:
                return DeceptiveKind.TRIVIAL_OUTPUT, (
                    f"{where} returned {'all zeros' if trivial.zero else 'one constant'}, which passed the earlier "
                    f"calls only because their outputs sit within the tolerance of it (a degenerate task)")
            return DeceptiveKind.CACHED_OUTPUT, f"{where} returned the outputs of trial {j} for new input content"
    unwritten = _unwritten(expected, got, atol, rtol)
    if unwritten:
        how = ("the earlier calls' correct values came from stale memory" if earlier else
               "it passed nothing: its outputs are whatever memory held, which passes a check whose reference ran "
               "just before in the same process")
        return DeceptiveKind.STALE_MEMORY, (f"{where}: {unwritten} output elements were never written (they hold "
                                            f"the poison left in freed memory; {how})")
    return None

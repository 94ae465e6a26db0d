"""The keep rule of the curated set: verified correct, not deceptive, and at least `min_speedup` times faster.

Every pair gets a decision that says which rule kept or dropped it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dice_kernels.data.records import UNVERIFIED, VERIFIED, Decision, PairRecord

STAGE = "filter"


@dataclass(frozen=True)
class FilterConfig:
    min_speedup: float = 2.0
    # Reference runtimes below this floor are too noisy for a speedup to mean anything (repeats of
    # 4-75 µs kernels varied by a median factor of 1.74). 0 disables the rule.
    min_ref_time_ms: float = 0.0
    # Let unverified pairs through (marked) so the later stages can run on a machine without a GPU.
    keep_unverified: bool = False


def _judge(r: PairRecord, cfg: FilterConfig) -> tuple[str, str]:
    v = r.verification
    if v.status == UNVERIFIED:
        if cfg.keep_unverified:
            return "mark", f"kept unverified ({v.reason}) because keep_unverified is set"
        return "drop", f"unverified: {v.reason}"
    if v.status != VERIFIED:
        return "drop", f"not verified: {v.reason}"
    if v.speedup is None:
        return "drop", "correct but not timed: no speedup to filter on"
    if v.ref_time_ms is not None and v.ref_time_ms < cfg.min_ref_time_ms:
        return "drop", f"reference takes {v.ref_time_ms:.4f} ms < {cfg.min_ref_time_ms} ms: timing noise dominates"
    if v.speedup < cfg.min_speedup:
        return "drop", f"speedup {v.speedup:.2f}x < {cfg.min_speedup}x"
    return "keep", f"correct and {v.speedup:.2f}x >= {cfg.min_speedup}x"


def speed_filter(records: list[PairRecord], cfg: FilterConfig = FilterConfig()) -> tuple[list[PairRecord], list[Decision]]:
    kept, decisions = [], []
    for r in records:
        action, reason = _judge(r, cfg)
        decisions.append(Decision(STAGE, r.id, action, reason, {"speedup": r.verification.speedup}))
        if action != "drop":
            kept.append(r)
    return kept, decisions

"""harness/process/reference_cache.py on its own: a kept reference comes back as the run left it; what is not a
whole successful run, or is larger than the budget, is not kept; beyond the budget the least recently used goes."""

from __future__ import annotations

import torch

from dice_kernels.harness.process.reference_cache import KEPT, ReferenceCache, reference_key
from dice_kernels.harness.references import Reference

MIB = 1 << 20


def _reference(mib: int = 1, **changes) -> Reference:
    """A successful run's reference whose two trials take `mib` MiB together (float32)."""
    trial = [torch.randn(mib * MIB // 8)]
    fields = dict(outputs=[trial, [trial[0].clone()]], time_ms=None, timing_outputs=None,
                  degenerate={"degenerate": False}, hardened=[], output_findings=frozenset({"aliases_input"}),
                  stateful=True, wall_s=1.25)
    return Reference(**{**fields, **changes})


def test_a_kept_reference_comes_back_with_the_fields_a_run_gives():
    cache, ref = ReferenceCache(), _reference()
    assert cache.get("k") is None
    cache.put("k", ref, 4 * MIB)
    kept = cache.get("k")
    assert kept is not None and set(kept) == {*KEPT, "reused_from"} and kept["reused_from"]
    assert all(kept[name] is getattr(ref, name) for name in KEPT)
    assert cache.held_bytes == MIB
    assert reference_key("a", "task") != reference_key("b", "task") != reference_key("a", "other")


def test_only_whole_successful_runs_within_the_budget_are_kept():
    cache = ReferenceCache()
    for i, ref in enumerate([_reference(outputs=None), _reference(retried="runtime_error: once"),
                             _reference(deferred_need=5), _reference(reused_from="earlier"), _reference(mib=8)]):
        cache.put(str(i), ref, 4 * MIB)
        assert cache.get(str(i)) is None
    assert cache.held_bytes == 0


def test_beyond_the_budget_the_least_recently_used_goes():
    cache = ReferenceCache()
    for key in "abc":
        cache.put(key, _reference(), 3 * MIB)
    assert cache.get("a") is not None  # now the most recently used: b is the oldest
    cache.put("d", _reference(), 3 * MIB)
    assert [k for k in "abcd" if cache.get(k) is not None] == ["a", "c", "d"]
    cache.put("c", _reference(mib=2), 3 * MIB)  # replaced, not counted twice: a and d leave room for it only
    assert cache.held_bytes <= 3 * MIB and cache.get("c") is not None

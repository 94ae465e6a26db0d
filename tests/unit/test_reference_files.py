"""harness/process/reference_cache.py on its own: a kept reference reads back exactly (dtypes, shapes, nesting, the
non-tensor fields); what is not a whole successful run, or is too large, is not kept; a file that is not ours is a
miss and runs no code."""

from __future__ import annotations

import torch

from dice_kernels.harness.process.reference_cache import REFERENCES_DIR, ReferenceCache
from dice_kernels.harness.references import Reference


def _reference(**changes) -> Reference:
    trial = [torch.randn(3, 4), torch.tensor([1.5, float("nan")], dtype=torch.bfloat16),
             torch.arange(6, dtype=torch.int8).reshape(2, 3), torch.ones(2, dtype=torch.complex64) * 1j,
             torch.tensor(True), torch.empty(0, 5, dtype=torch.float16), torch.tensor(7, dtype=torch.int64)]
    fields = dict(outputs=[trial, [t.clone() for t in trial]], time_ms=None, timing_outputs=[torch.randn(2, 2)],
                  degenerate={"zero_output_passes": False, "degenerate": True},
                  hardened=[(2, [torch.randn(5, dtype=torch.float64)])],
                  output_findings=frozenset({"aliases_input", "mutates_input"}), stateful=True, wall_s=1.25)
    return Reference(**{**fields, **changes})


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_kept_reference_reads_back_exactly(tmp_path):
    cache, ref = ReferenceCache(tmp_path, "context", 1 << 20), _reference()
    assert cache.get("task") is None
    cache.put("task", ref)
    kept = cache.get("task")
    assert kept is not None and kept.pop("reused_from")
    for name, value in kept.items():  # bit for bit (NaN included), dtype, shape and nesting
        assert _same(getattr(ref, name), value), name
    assert set(kept) == {"outputs", "timing_outputs", "hardened", "degenerate", "output_findings", "stateful", "wall_s"}
    # another context or task is another entry
    assert ReferenceCache(tmp_path, "other", 1 << 20).get("task") is None and cache.get("other-task") is None


def test_only_whole_successful_runs_within_the_cap_are_kept(tmp_path):
    cache = ReferenceCache(tmp_path, "context", 1 << 20)
    for i, ref in enumerate([_reference(outputs=None), _reference(retried="runtime_error: CUDA error 304"),
                             _reference(outputs=None, deferred_need=1 << 30),
                             _reference(reused_from="2026-12-06T10:00:00+00:00"),
                             _reference(timing_outputs=[torch.empty(1 << 18)])]):  # 1 MiB more than the cap
        cache.put(f"task{i}", ref)
    assert not list((tmp_path / REFERENCES_DIR).glob("*"))


class _RunsCode:
    def __reduce__(self):
        return (exec, ("open(__import__('os').environ['MARKER'], 'w').write('ran')",))


def test_a_damaged_or_foreign_file_is_a_miss_and_runs_no_code(tmp_path, monkeypatch):
    cache = ReferenceCache(tmp_path, "context", 1 << 20)
    cache.put("task", _reference())
    path = cache.path("task")
    marker = tmp_path / "marker"
    monkeypatch.setenv("MARKER", str(marker))
    good = torch.load(path, weights_only=True)
    for body in (b"", path.read_bytes()[:100]):
        path.write_bytes(body)
        assert cache.get("task") is None
    torch.save(_RunsCode(), path)  # torch.load without weights_only would run it
    assert cache.get("task") is None
    torch.save({**good, "outputs": [[torch.zeros(1)], [torch.zeros(1), torch.zeros(1)]]}, path)  # ragged trials
    assert cache.get("task") is None
    torch.save({**good, "extra": 1}, path)
    assert cache.get("task") is None
    torch.save({**good, "key": ReferenceCache(tmp_path, "other", 0).key("task")}, path)  # another entry's, renamed
    assert cache.get("task") is None
    torch.save({**good, "stateful": "yes"}, path)
    assert cache.get("task") is None
    assert not marker.exists()
    cache.put("task", _reference())  # a run replaces it
    assert cache.get("task") is not None

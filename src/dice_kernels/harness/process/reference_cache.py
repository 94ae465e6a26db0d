"""Reference outputs kept across the batches of one process (`EvalConfig.reuse_verdicts`): a byte-bounded,
least-recently-used map from (verdict context, task code) to what a reference run produced, shared by every
evaluator in the process. Kept in the parent's memory only: workers cannot read it, where a file could be read by a
candidate (writes are confined, reads are not). references.py decides when a kept reference stands in for a run."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from dice_kernels.harness.timing.loop import tensor_bytes

if TYPE_CHECKING:
    from dice_kernels.harness.references import Reference

# the Reference fields a later batch reuses: the outputs side of a run. The timing side (time_ms, timing, sol,
# compile_baseline) stays in baselines.sqlite, its one store; `wall_s` is the run's, which candidates' run
# timeouts scale with
KEPT = ("outputs", "timing_outputs", "hardened", "degenerate", "output_findings", "stateful", "wall_s")


def reference_key(context: str, task_sha256: str) -> str:
    """The task's code under one verdict context (store.verdict_context: the settings that decide a reference's
    outputs, the platform and the harness's code)."""
    return hashlib.sha256(f"{context}:{task_sha256}:reference".encode()).hexdigest()


def _size(fields: dict) -> int:
    return tensor_bytes([fields["outputs"], fields["timing_outputs"] or [], fields["hardened"]])


class ReferenceCache:
    """`get(key)` a kept reference's fields (with `reused_from`: when it ran) or None; `put(key, ref, budget)` a
    reference that ran once and succeeded, then drop the least recently used until all kept take at most `budget`
    bytes. Safe to call from a batch's run threads."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, dict] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> dict | None:
        with self._lock:
            fields = self._kept.get(key)
            if fields is not None:
                self._kept.move_to_end(key)
            return fields

    def put(self, key: str, ref: Reference, budget: int) -> None:
        # failed, retried (its hardened trials dropped), deferred or reused references are not what a run gives
        if ref.outputs is None or ref.retried or ref.deferred_need or ref.reused_from:
            return
        fields = {name: getattr(ref, name) for name in KEPT}
        fields["reused_from"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        size = _size(fields)
        if size > budget:
            return
        with self._lock:
            if key in self._kept:
                self._bytes -= _size(self._kept.pop(key))
            self._kept[key] = fields
            self._bytes += size
            while self._bytes > budget:
                self._bytes -= _size(self._kept.popitem(last=False)[1])

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._bytes


KEPT_REFERENCES = ReferenceCache()  # one per process: a demo's benchmarks each open their own evaluator

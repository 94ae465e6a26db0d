"""Reference outputs kept across batches and processes (`EvalConfig.reuse_verdicts`): one file per task and verdict
context in <cache_dir>/references/, written atomically by the parent and read back with torch.load(weights_only=True)
and checked field by field, so a damaged or foreign file is a miss (the reference runs again and replaces it), never
code run. references.py decides when a kept reference may stand in for a run."""

from __future__ import annotations

import hashlib
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from dice_kernels.harness.timing.loop import tensor_bytes

if TYPE_CHECKING:
    from dice_kernels.harness.references import Reference

REFERENCES_DIR = "references"
FORMAT = 1  # a file of another format is a miss: change it with the fields below


def _tensors(v: object) -> bool:
    return isinstance(v, list) and all(isinstance(t, torch.Tensor) and t.layout is torch.strided for t in v)


def _hardened(v: object) -> bool:
    return isinstance(v, list) and all(isinstance(h, tuple) and len(h) == 2 and type(h[0]) is int and _tensors(h[1])
                                       for h in v)


def _flags(v: object) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and type(b) is bool for k, b in v.items())


# the Reference fields a later batch reuses, each with the check its stored value must pass: the outputs side of a
# run; the timing side (time_ms, timing, sol, compile_baseline) stays in baselines.sqlite, its one store
KEPT: dict[str, Callable[[object], bool]] = {
    "outputs": lambda v: isinstance(v, list) and bool(v) and all(_tensors(trial) for trial in v),
    "timing_outputs": lambda v: v is None or _tensors(v),
    "hardened": _hardened,
    "degenerate": _flags,
    "output_findings": lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),  # a frozenset's items
    "stateful": lambda v: type(v) is bool,
    "wall_s": lambda v: type(v) is float,  # the run's: a candidate's run timeout scales with it
}


class ReferenceCache:
    """`get(task_sha256)` the kept reference's fields (with `reused_from`, when it ran) or None; `put(task_sha256,
    ref)` a reference that ran once and succeeded, when its tensors take at most `max_bytes`."""

    def __init__(self, cache_dir: Path, context: str, max_bytes: int):
        self.dir, self.context, self.max_bytes = Path(cache_dir) / REFERENCES_DIR, context, max_bytes

    def key(self, task_sha256: str) -> str:
        """The task's code under one verdict context (store.verdict_context: the settings that decide a reference's
        outputs, the platform and the harness's code)."""
        return hashlib.sha256(f"{self.context}:{task_sha256}:reference".encode()).hexdigest()

    def path(self, task_sha256: str) -> Path:
        return self.dir / f"{self.key(task_sha256)}.pt"

    def get(self, task_sha256: str) -> dict | None:
        try:
            entry = torch.load(self.path(task_sha256), map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 - missing, truncated, damaged or not a weights-only file: a miss
            return None
        if not (isinstance(entry, dict) and set(entry) == {*KEPT, "format", "key", "measured_at"}
                and entry["format"] == FORMAT and entry["key"] == self.key(task_sha256)
                and isinstance(entry["measured_at"], str) and all(ok(entry[name]) for name, ok in KEPT.items())
                and all(len(trial) == len(entry["outputs"][0]) for trial in entry["outputs"])):
            return None
        kept = {name: entry[name] for name in KEPT}
        kept["output_findings"] = frozenset(kept["output_findings"])
        return {**kept, "reused_from": entry["measured_at"]}

    def put(self, task_sha256: str, ref: Reference) -> None:
        # failed, retried (its hardened trials dropped), deferred or reused references are not what a run gives
        if ref.outputs is None or ref.retried or ref.deferred_need or ref.reused_from:
            return
        if tensor_bytes([ref.outputs, ref.timing_outputs, ref.hardened]) > self.max_bytes:
            return
        entry = {name: getattr(ref, name) for name in KEPT}
        entry.update(output_findings=sorted(ref.output_findings), format=FORMAT, key=self.key(task_sha256),
                     measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
        tmp = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                torch.save(entry, f)
            os.replace(tmp, self.path(task_sha256))  # readers see the old file or the whole new one
        except OSError:  # a full or read-only disk: the reference was computed, only later batches lose it
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

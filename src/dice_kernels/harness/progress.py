"""Progress of a batch: a rich bar with live outcome counts, or, without a terminal, one line per result and a
heartbeat naming what is in flight and in which phase."""

from __future__ import annotations

import sys
import threading
import time

from dice_kernels.harness.outcomes import EvalResult

QUEUED = "queued"  # the phase of a candidate waiting for a build slot or a run worker: counted, not listed


class Progress:
    """A rich progress bar with live outcome counts. When disabled (batch jobs, logs without a terminal): one plain
    line per result evaluated, and every `heartbeat_s` a line naming what is in flight and in which phase, so a
    long unattended run shows where it is and which candidate it is stuck on."""

    def __init__(self, total: int, enabled: bool, heartbeat_s: float = 60.0):
        self.counts: dict[str, int] = {}
        self.total = total
        self._inflight: dict[str, tuple[str, float]] = {}  # candidate id -> (phase, since)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._p = None
        if enabled and total:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._p = Progress(TextColumn("[bold]eval"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                               TextColumn("{task.description}"))
            self._p.start()
            self._id = self._p.add_task("", total=total)
        elif total:
            threading.Thread(target=self._heartbeat, args=(heartbeat_s,), name="heartbeat", daemon=True).start()

    def phase(self, candidate_id: str, name: str) -> None:
        """`candidate_id` entered phase `name` (queued, build, reference, run; queued: waiting for a build slot or
        a run worker)."""
        with self._lock:
            self._inflight[candidate_id] = (name, time.monotonic())

    def advance(self, r: EvalResult, resumed: bool = False) -> None:
        key = "resumed" if resumed else r.outcome.value
        with self._lock:
            self._inflight.pop(r.candidate_id, None)
            self.counts[key] = self.counts.get(key, 0) + 1
            done = sum(self.counts.values())
        if self._p:
            self._p.update(self._id, advance=1,
                           description=" ".join(f"{k}={v}" for k, v in sorted(self.counts.items())))
        elif not resumed:
            print(f"eval {done}/{self.total} {r.candidate_id}: {r.outcome.value} ({r.wall_s or 0.0:.1f}s)",
                  file=sys.stderr, flush=True)

    def _heartbeat(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            now = time.monotonic()
            with self._lock:
                busy = sorted(self._inflight.items(), key=lambda kv: kv[1][1])
                done = sum(self.counts.values())
            queued = sum(1 for _, (phase, _) in busy if phase == QUEUED)
            items = ", ".join(f"{cid} {phase} {now - since:.0f}s" for cid, (phase, since) in busy if phase != QUEUED)
            if busy:
                print(f"eval {done}/{self.total} done; in flight: {items or 'none'}"
                      + (f"; {queued} queued" if queued else ""), file=sys.stderr, flush=True)

    def close(self) -> None:
        self._stop.set()
        if self._p:
            self._p.stop()

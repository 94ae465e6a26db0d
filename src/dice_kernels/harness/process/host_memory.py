"""The parent's host-memory ledger for reference outputs: a task's reference is admitted only when its outputs,
and the frames its candidates will send, fit beside those of the tasks already admitted, so several tasks with
multi-GiB outputs never hold the parent's memory at once (five did on an H200 run, and the OOM killer took the
whole batch). A task that does not fit waits; a task that fits nowhere runs when nothing else is held.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from dice_kernels.harness.process.sandbox import StopWorker


class OutputsDeferred(StopWorker):
    """A reference's first frame showed that its outputs do not fit beside what other tasks hold: the worker is
    stopped and the task waits for room (`need` bytes)."""

    def __init__(self, need: int, held: int, budget: int):
        super().__init__(f"reference outputs need {need / 2**30:.2f} GiB; other tasks hold {held / 2**30:.2f} GiB "
                         f"of the {budget / 2**30:.2f} GiB output budget")
        self.need = need


def task_need_bytes(frame_bytes: int, trials: int, candidates_in_flight: int) -> int:
    """Host memory a task holds at its peak, given one trial's outputs: the reference's trials and its re-checked
    timing call, and for each candidate in flight the trial being compared and the one kept for the robust check."""
    return frame_bytes * (trials + 1 + 2 * candidates_in_flight)


@dataclass
class OutputLedger:
    """Bytes reserved per task against `budget`. A reservation fits when the total stays within the budget, or
    when no other task holds anything (the machine's own limit, `_OutputLimits`, then decides)."""

    budget: int
    _held: dict[str, int] = field(default_factory=dict)
    _changed: threading.Condition = field(default_factory=threading.Condition)

    def held(self, but: str = "") -> int:
        with self._changed:
            return sum(n for task, n in self._held.items() if task != but)

    def reserve(self, task_id: str, nbytes: int) -> bool:
        """Reserve `nbytes` for `task_id` if they fit; True when reserved."""
        with self._changed:
            others = sum(n for task, n in self._held.items() if task != task_id)
            if others and others + self._held.get(task_id, 0) + nbytes > self.budget:
                return False
            self._held[task_id] = self._held.get(task_id, 0) + nbytes
            return True

    def release(self, task_id: str) -> None:
        with self._changed:
            if self._held.pop(task_id, None) is not None:
                self._changed.notify_all()

    def wait_for_release(self, timeout_s: float) -> None:
        """Block until some task releases its reservation, or `timeout_s` passes."""
        with self._changed:
            self._changed.wait(timeout_s)

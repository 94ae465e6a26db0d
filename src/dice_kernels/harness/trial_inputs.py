"""A trial's inputs, the same in the reference's and a candidate's worker: `task.get_inputs()` seeded per trial,
on the job's device, optionally written into the previous trial's tensors (same pointers, new content)."""

from __future__ import annotations

import types

from dice_kernels.harness.protocol import RunJob


def seed_all(seed: int) -> None:
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:
        pass


def _to_device(x, device):
    import torch

    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(v, device) for v in x)
    return x


def trial_inputs(task: types.ModuleType, job: RunJob, seed: int, into: list | None = None) -> list:
    """The task's inputs for `seed`; with `into`, their values are written into those tensors (same pointers)."""
    fresh = _generated_inputs(task, job, seed)
    return fresh if into is None else copy_into(into, fresh)


def _generated_inputs(task: types.ModuleType, job: RunJob, seed: int) -> list:
    """`task.get_inputs()` seeded with `seed`, on the job's device. With `job.inputs_on_device` it runs with the
    device as torch's default device, so its factory calls (`torch.randn(16, 256, 512, 256)`) fill device memory
    directly instead of costing seconds of one CPU core and a copy each; a get_inputs that cannot run that way
    (numpy, CPU-only ops) runs on the CPU as KernelBench runs it. Reference and candidate take the same path."""
    import torch

    if job.inputs_on_device:
        seed_all(seed)
        try:
            with torch.device(job.device):
                return _to_device(list(task.get_inputs()), job.device)
        except Exception:  # noqa: BLE001 - the task's own code: the CPU path below decides
            pass
    seed_all(seed)
    return _to_device(list(task.get_inputs()), job.device)


def copy_into(into: list, fresh: list) -> list:
    """`fresh`'s values, in `into`'s tensors wherever shape, dtype and device agree."""
    import torch

    if len(into) != len(fresh):
        return fresh
    reused = []
    for old, new in zip(into, fresh):
        same = (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.shape == new.shape
                and old.dtype == new.dtype and old.device == new.device)
        reused.append(old.copy_(new) if same else new)
    return reused

"""A trial's inputs, the same in the reference's and a candidate's worker: `task.get_inputs()` seeded per trial,
on the job's device, optionally written into the previous trial's tensors (same pointers, new content); and the
hardened inputs that decide degenerate tasks (`harden`: spikes, and a signed version of non-negative inputs)."""

from __future__ import annotations

import types

from dice_kernels.harness.process.protocol import RunJob


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


HARDENED_TRIALS = 2  # `harden` variants: 0 spikes of either sign keeping non-negative inputs non-negative, 1 signed
HARDENED_SEED = 50_000  # variant v's inputs are seeded `seed + HARDENED_SEED + v`: content no other call sees


def harden(inputs: list, variant: int, seed: int) -> list:
    """Inputs on which a trivial answer stops passing, in place: every floating tensor gets one spike per 4,096
    elements (at least one), 8-16 times its largest magnitude, at seeded places. Variant 0 keeps a non-negative
    tensor non-negative (the domain of log, sqrt, and of ReLU's identity shortcut is kept); variant 1 first
    centres it and scales it by 4, so signs appear. A large-N mean is then carried by a few elements (a subsample
    misses them, one constant no longer fits every trial); outputs far below atol (softmax over a wide row, x /
    |x|) grow above it; an identity on [0, 1) stops being one. The reference decides whether it is defined
    there: the parent keeps only variants on which its outputs are finite and no trivial answer passes
    (degenerate.breaking_trials)."""
    import torch

    from dice_kernels.harness.robust.output_checks import tensors_in

    g = torch.Generator().manual_seed(seed)
    for x in tensors_in(inputs):
        if not x.is_floating_point() or not x.numel():
            continue
        flat = x.view(-1) if x.is_contiguous() else None
        if flat is None:
            continue
        non_negative = bool(x.min() >= 0)
        if variant == 1 and non_negative:
            x.sub_(x.mean()).mul_(4)
            non_negative = False
        top = float(x.abs().max()) or 1.0
        k = max(1, x.numel() // 4096)
        where = torch.randint(0, x.numel(), (k,), generator=g)  # not randperm: a GiB input would need GiBs more
        size = top * (8 + 8 * torch.rand(k, generator=g, dtype=torch.float64))
        if not non_negative:
            size = size * (torch.randint(0, 2, (k,), generator=g) * 2 - 1)
        flat[where.to(x.device)] = size.to(x.dtype).to(x.device)
    return inputs

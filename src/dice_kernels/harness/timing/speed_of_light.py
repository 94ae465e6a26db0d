"""Speed-of-light bounds: a task's minimum bytes moved at the device's measured bandwidth bounds any correct
implementation's time; its reference's FLOPs at the measured peak say when a candidate did less arithmetic. The
ceilings are measured in the reference worker (`measure_ceilings`) and cached by the parent (platform.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from dice_kernels.harness.timing.cache_flush import _MiB, is_cuda
from dice_kernels.harness.timing.loop import _CudaEvent, _cuda_sync, _now_ns, synchronize, tensor_bytes


@dataclass(frozen=True)
class Ceilings:
    """Measured hardware ceilings of one device: memory bandwidth (read + write bytes per second) and peak
    matmul FLOP/s for one dtype."""

    bandwidth_bytes_s: float
    peak_flops: float
    dtype: str


def min_bytes_moved(inputs: Any, outputs: Any, params: Iterable[torch.Tensor] = ()) -> int:
    """A lower bound on DRAM traffic: every input (and parameter) read once, every output written once."""
    return tensor_bytes(inputs) + tensor_bytes(outputs) + tensor_bytes(list(params))


def count_flops(model: Callable[..., Any], inputs: Sequence[Any]) -> int:
    """FLOPs of one forward as counted by `FlopCounterMode` (matmul/conv family; 2*M*N*K for a matmul), 0 when
    unknown. Call it on the task's reference `Model`, never on candidate code: the bound belongs to the task."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            model(*inputs)
        return int(counter.get_total_flops())
    except Exception:  # noqa: BLE001 - an op the counter cannot trace means "unknown", not a failure
        return 0


def speed_of_light_ms(bytes_moved: float, bandwidth_bytes_s: float) -> float:
    """Lower bound on one call of any correct implementation: the minimum bytes moved at full bandwidth (0 when
    unknown). The reference's FLOPs are no such bound: a candidate may compute the same result with fewer
    (KernelBench L1/12 builds `diag(A) @ B` as a dense matmul; a row scaling does it with N*M multiplies), so
    they give `reference_flops_ms` instead, which is reported and never quarantines."""
    return bytes_moved / bandwidth_bytes_s * 1e3 if bandwidth_bytes_s > 0 else 0.0


def reference_flops_ms(flops: float, peak_flops: float) -> float:
    """The reference algorithm's FLOPs at the measured peak (0 when unknown): beating it means doing less
    arithmetic than the reference does, which is either an algorithmic shortcut or a result not computed."""
    return flops / peak_flops * 1e3 if peak_flops > 0 else 0.0


def faster_than_light(time_ms: float, bound_ms: float, slack: float = 0.9) -> bool:
    """True when a measured time beats a lower bound by more than the slack allows."""
    return bound_ms > 0 and time_ms < slack * bound_ms


def measure_ceilings(device: str | torch.device, dtype: torch.dtype = torch.float32, reps: int = 5) -> Ceilings:
    """Best-of-`reps` copy bandwidth (bytes read + written) and FLOP/s of a large square matmul in `dtype`.

    CUDA: a 1 GiB copy (the HBM rate: the protocol flushes L2 before every timed call, so a kernel's data comes
    from HBM) and an 8192^3 matmul, events. CPU: the best of 256 KiB, 4 MiB and 64 MiB copies and a 512^3
    matmul, perf_counter: on a CPU the flush cannot be trusted to evict a large shared last-level cache (nor a
    VM's view of it), so the bound uses the fastest rate any working-set size reaches. Measure once per
    (device, torch version, dtype) and cache: it takes seconds on a GPU."""
    cuda = is_cuda(device)
    copy_sizes, n = ([1 << 30], 8192) if cuda else ([256 << 10, 4 * _MiB, 64 * _MiB], 512)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def best_ms(fn: Callable[[], Any]) -> float:
        fn()
        synchronize(device)
        best = math.inf
        for _ in range(reps):
            if cuda:
                start, end = _CudaEvent(enable_timing=True), _CudaEvent(enable_timing=True)
                start.record()
                fn()
                end.record()
                _cuda_sync(torch.device(device))
                best = min(best, start.elapsed_time(end))
            else:
                t0 = _now_ns()
                fn()
                best = min(best, (_now_ns() - t0) / 1e6)
        return best

    bandwidth = 0.0
    for size in copy_sizes:
        src = torch.empty(size, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        bandwidth = max(bandwidth, 2 * size / (best_ms(lambda: dst.copy_(src)) / 1e3))
    mm_ms = best_ms(lambda: torch.mm(a, b))
    return Ceilings(bandwidth_bytes_s=bandwidth, peak_flops=2 * n**3 / (mm_ms / 1e3),
                    dtype=str(dtype).removeprefix("torch."))

"""Cold caches for the timing protocol (timing/loop.py): the size of the cache a flush must evict (the GPU's L2, the
CPU's largest level), the flush run before every timed call, and the reset of persisting-L2 lines a candidate may
have pinned with an access-policy window. Never imports candidate code; reads sysfs and /proc/self/maps only."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
from pathlib import Path
from typing import Callable

import torch

_MiB = 1 << 20
_CPU_L2_FALLBACK = 32 * _MiB  # when sysfs is unreadable: a typical server last-level cache


def is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def _cpu_cache_bytes() -> int:
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = Path(path).read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=_CPU_L2_FALLBACK)


def l2_size_bytes(device: str | torch.device) -> int:
    """The cache a flush must evict: the GPU's L2, or on CPU the largest cache level cpu0 reports."""
    if is_cuda(device):
        return int(torch.cuda.get_device_properties(torch.device(device)).L2_cache_size)
    return _cpu_cache_bytes()


@functools.lru_cache(maxsize=1)
def _libcudart() -> ctypes.CDLL | None:
    """The CUDA runtime torch itself loaded (so the call reaches the same context), else any on the path."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart" in line})
        for path in paths:
            if os.path.exists(path):
                return ctypes.CDLL(path)
    except OSError:
        pass
    name = ctypes.util.find_library("cudart")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_CUDA_LIMIT_PERSISTING_L2 = 0x06  # cudaLimitPersistingL2CacheSize


def reset_persisting_l2(disable: bool = True) -> bool:
    """Best effort: demote all persisting L2 lines to normal (and, with `disable`, shrink the persisting carve-out
    to 0), so an access-policy window set by a candidate cannot keep its data resident across the flush. True if
    the calls succeeded; never raises (False without CUDA or libcudart)."""
    if not torch.cuda.is_available():
        return False
    try:
        lib = _libcudart()
        if lib is None:
            return False
        ok = True
        if disable:
            ok = lib.cudaDeviceSetLimit(ctypes.c_int(_CUDA_LIMIT_PERSISTING_L2), ctypes.c_size_t(0)) == 0
        return lib.cudaCtxResetPersistingL2Cache() == 0 and ok
    except (OSError, AttributeError):
        return False


def make_flush(device: str | torch.device, l2_bytes: int | None = None) -> Callable[[], None]:
    """A callable that overwrites 2 x the cache size (and, on CUDA, resets persisting L2) so every timed iteration
    starts cold. CUDA: a `zero_()` on a device buffer, queued on the current stream; CPU: `fill_` of a host array."""
    size = 2 * (l2_bytes if l2_bytes is not None else l2_size_bytes(device))
    if is_cuda(device):
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        reset_persisting_l2(disable=True)  # once: changing a device limit may be slow; a candidate re-raising it
        # still has its persisting lines demoted before every call

        def flush_cuda() -> None:
            reset_persisting_l2(disable=False)
            buf.zero_()

        return flush_cuda
    host = torch.empty(size, dtype=torch.uint8)
    counter = [0]

    def flush_cpu() -> None:
        counter[0] = (counter[0] + 1) & 0xFF  # a new value each time so no layer can skip a no-op write
        host.fill_(counter[0])

    return flush_cpu

"""The machine a run measures on: `Platform` (backend, hardware, CUDA arch, torch; part of every result and of
the build-cache key), the device lock's name for it, and its measured speed-of-light ceilings, cached across runs
beside the build cache."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dice_kernels.harness.config import usable_cpus
from dice_kernels.harness.timing.speed_of_light import Ceilings


@dataclass(frozen=True)
class Platform:
    """The machine and software a run measures on; part of every result and of the build-cache key."""

    backend: str
    hardware: str
    cuda_arch: str  # "9.0" on an H200; "" on the CPU backend
    torch_version: str
    gpu_memory_gib: float = 0.0  # the GPU's memory (how many run workers it holds at once); 0 on the CPU backend

    @classmethod
    def detect(cls, backend: str) -> "Platform":
        if backend == "cuda":
            name, arch, memory_gib = _gpu_name_arch_memory()
            return cls("cuda", name, arch, torch.__version__, memory_gib)
        return cls("cpu", _cpu_name(), "", torch.__version__)


def _first_visible_gpu() -> str:
    """The GPU workers see as cuda:0: CUDA_VISIBLE_DEVICES' first entry (an index or a UUID; "0" when unset)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0"


def device_lock_key(platform: Platform) -> str:
    """The device an evaluation's workers use, named as every evaluation on this machine names it: "cpu", or
    "cuda-" plus `_first_visible_gpu()`."""
    if platform.backend != "cuda":
        return "cpu"
    return "cuda-" + re.sub(r"[^A-Za-z0-9_.-]", "_", _first_visible_gpu())


def _gpu_name_arch_memory() -> tuple[str, str, float]:
    # the GPU the workers will see first, named as nvidia-smi -i takes it; nvidia-smi keeps the parent free of a
    # CUDA context
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap,memory.total",
                               "--format=csv,noheader,nounits", "-i", _first_visible_gpu()],
                              capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        name, cap, mib = (s.strip() for s in line.rsplit(",", 2))
        # "[N/A]" where the driver does not say (MIG instances): counted as a small GPU
        return name, cap, round(float(mib) / 1024, 1) if mib.replace(".", "", 1).isdigit() else 0.0
    except (OSError, subprocess.SubprocessError, ValueError):
        major, minor = torch.cuda.get_device_capability(0)
        memory = torch.cuda.get_device_properties(0).total_memory
        return torch.cuda.get_device_name(0), f"{major}.{minor}", round(memory / (1 << 30), 1)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({usable_cpus()} cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine()



class CeilingsCache:
    """This machine's measured ceilings (bandwidth, peak FLOPs) per dtype, read at start and merged as references
    measure them; `known` is what the speed-of-light bound uses."""

    def __init__(self, cache_dir: Path, platform: Platform):
        self.cache_dir, self.platform = cache_dir, platform
        self._lock = threading.Lock()
        self.known: dict[str, Ceilings] = self._read().get(self.key(), {})

    def _file(self) -> Path:
        return self.cache_dir / "ceilings.json"

    def key(self) -> str:
        """The machine and software the ceilings (and the baselines) belong to."""
        return f"{self.platform.backend}|{self.platform.hardware}|torch {self.platform.torch_version}"

    def _read(self) -> dict[str, dict[str, Ceilings]]:
        """Measured ceilings per machine key and dtype, cached across runs in the build cache's folder (measuring
        takes seconds on a GPU: a 1 GiB copy and an 8192^3 matmul)."""
        try:
            everything = json.loads(self._file().read_text())
            return {key: {dtype: Ceilings(**c) for dtype, c in per_dtype.items()}
                    for key, per_dtype in everything.items()}
        except (OSError, ValueError, TypeError, AttributeError):
            return {}

    def remember(self, dtype: str, measured: list[dict]) -> None:
        """Merge measurements into the cache. Ceilings only ever go up: every measurement is a rate the machine
        reached, so the highest one seen is the tightest valid bound, and one taken under load cannot lower it."""
        with self._lock:
            everything = self._read()  # again: another run may have written since this one started
            known = everything.setdefault(self.key(), {})
            for c in (Ceilings(**m) for m in measured):
                old = known.get(dtype, c)
                known[dtype] = Ceilings(max(old.bandwidth_bytes_s, c.bandwidth_bytes_s),
                                        max(old.peak_flops, c.peak_flops), dtype)
            self.known = known
            path = self._file()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({key: {d: asdict(c) for d, c in per_dtype.items()}
                                       for key, per_dtype in everything.items()}, indent=1))
            os.replace(tmp, path)

"""The content-addressed build cache: a candidate's extensions are built once per (harness, torch, backend, arch,
code) by a sandboxed build worker (compiling/in_sandbox.py) and reused by every run and later batch that needs them.
`BuildAcceleration` is the one interface to the build speed-ups (compiling/speed.py: precompiled headers, spare-time
headers, lighter CUDA headers); `BuildConfig.fast=False` (`--no-build-fast`) turns every one of them off."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dice_kernels import __version__
from dice_kernels.harness.compiling import bare_cuda
from dice_kernels.harness.compiling.speed import (announce_pch, build_pch, may_build_bare, pch_variants, plan_pch,
                                                   planned_pch, store_torch_macros, torch_macros_file)
from dice_kernels.harness.config import EvalConfig
from dice_kernels.harness.outcomes import Outcome
from dice_kernels.harness.timing.platform import Platform
from dice_kernels.harness.process.protocol import BuildJob
from dice_kernels.harness.process.pool import Workers, cleanup, death_outcome


# What makes a program need a GPU: CUDA sources for load_inline, a kernel definition, or a .cu file. On the CPU
# backend such a program is set aside before any build (`needs_gpu`), as `dice data` leaves it unverified.
_CUDA_MARKERS = (
    ("cuda_sources", re.compile(r"\bcuda_sources\s*=")),
    ("__global__", re.compile(r"__global__")),
    (".cu file", re.compile(r"\.cu[\"']")),
)


def cuda_marker(code: str) -> str:
    """The first CUDA marker found in a program, or "" for a program that can run on the CPU."""
    for name, pattern in _CUDA_MARKERS:
        if pattern.search(code):
            return name
    return ""


@dataclass
class Build:
    """Outcome of building one distinct candidate program (shared by identical candidates)."""

    dir: Path | None
    ok: bool
    kind: str = ""
    error: str = ""
    compile_s: float = 0.0
    cache_hit: bool = False
    shortcuts: list = field(default_factory=list)  # build_speed savings per extension (worker BuildLog)
    wall_s: float = 0.0  # this run's wall time for the build (near zero on a cache hit)
    started_s: float = 0.0  # when it started, in seconds since the batch began


class BuildAcceleration:
    """Build speed-ups for a batch, behind one switch (`build.fast`): `start(codes)` plans the
    precompiled headers the batch's uncached programs need and builds them in the background, `job_fields()` is
    what a build job needs to use them, `finish()` ends a batch (a spare-time header not done is abandoned).
    Nothing here changes what a candidate's code means (compiling/speed.py)."""

    def __init__(self, config: EvalConfig, platform: Platform):
        self.enabled, self.cache_dir, self.cuda = config.build.fast, config.cache_dir, platform.backend == "cuda"
        self.pch: dict[str, str] = {}  # build_speed.planned_pch: headers build workers may use
        self.pch_light: dict[str, str] = {}  # the same for the light header
        self.pch_bare: dict[str, str] = {}  # and for the bare build's stub (C++-only modules, a CUDA module's main.cpp)
        self.torch_macros: str | None = None  # build_speed.torch_macros_file, where bare builds may run
        self.cuda_surroundings: str | None = None  # bare_cuda.surroundings_file, where bare CUDA builds may run
        self.pch_compiler: str | None = None  # build_speed.announce_pch: while some of them are being built
        self._thread: threading.Thread | None = None
        self._batch_over = threading.Event()

    def start(self, uncached: list[str]) -> None:
        # only programs that compile need a header: a batch of pure-Python candidates waited minutes of a cold
        # cache for one nobody used (a program that reaches the compiler unnamed just parses the real header)
        uncached = [code for code in uncached if ("cpp_extension" in code or "load_inline" in code)
                    and (self.cuda or not cuda_marker(code))]  # CUDA code on the CPU backend is never built
        if not self.enabled or not uncached:
            return
        # the light header serves the lighter CUDA attempts only, so CUDA builds only; the bare stub serves modules
        # whose sources name nothing of torch: C++-only ones (what the CPU backend builds) and, on a GPU, CUDA ones
        # whose launchers take addresses (the demo world's), whose main.cpp is then built on it
        bare = any(may_build_bare(code) for code in uncached)
        plans = plan_pch(self.cache_dir, with_cuda=self.cuda, variants=pch_variants(uncached), light=self.cuda,
                         bare=bare)
        self.pch, self.pch_light, self.pch_bare = (planned_pch(plans, kind) for kind in ("own", "light", "bare"))
        self.pch_compiler = announce_pch(plans, self.cache_dir)
        macros = torch_macros_file(self.cache_dir) if bare else None
        self.torch_macros = str(macros) if macros else None
        nvcc = bare_cuda.torch_nvcc() if self.cuda else None
        around = bare_cuda.surroundings_file(self.cache_dir, nvcc) if nvcc else None
        self.cuda_surroundings = str(around) if around else None
        # once per machine and torch; builds that start earlier wait for a header in main.cpp only, read torch's
        # macros themselves, and try no second bare CUDA attempt
        if self.pch_compiler or (macros and not macros.exists()) or (around and not around.exists()):
            self._batch_over.clear()

            def _build() -> None:
                if macros:
                    store_torch_macros(macros)
                if around:
                    bare_cuda.store(around, nvcc)
                build_pch(plans, abandon=self._batch_over)
                self.pch_compiler = None

            self._thread = threading.Thread(target=_build, name="pch", daemon=True)
            self._thread.start()

    def job_fields(self) -> dict:
        return {"pch": self.pch, "pch_light": self.pch_light, "pch_bare": self.pch_bare,
                "pch_compiler": self.pch_compiler, "torch_macros": self.torch_macros,
                "cuda_surroundings": self.cuda_surroundings,
                "light_headers": self.enabled}

    def finish(self) -> None:
        if self._thread is not None:
            # a half-written header is never published: the batch's own headers are finished for the next run,
            # a spare-time one not done yet is left for a run that needs it
            self._batch_over.set()
            self._thread.join()
            self._thread = None


def _cached(final: Path) -> Build | None:
    """The build recorded at `final` (a cache hit), or None."""
    manifest = final / "manifest.json"
    if not manifest.exists():
        return None
    m = json.loads(manifest.read_text())
    return Build(final, m["ok"], m.get("kind", ""), m.get("error", ""), m.get("compile_s", 0.0), True,
                 m.get("shortcuts", []))


class BuildCache:
    def __init__(self, config: EvalConfig, platform: Platform, workers: Workers):
        self.config, self.platform, self.workers = config, platform, workers
        self.acceleration = BuildAcceleration(config, platform)

    def _entry(self, code: str) -> tuple[str, Path]:
        fingerprint = json.dumps({"harness": __version__, "torch": self.platform.torch_version,
                                  "backend": self.platform.backend, "arch": self.platform.cuda_arch,
                                  "cuda": torch.version.cuda}, sort_keys=True)
        key = hashlib.sha256((fingerprint + "\0" + code).encode()).hexdigest()
        return key, self.config.cache_dir / key[:2] / key

    def is_cached(self, code: str) -> bool:
        return (self._entry(code)[1] / "manifest.json").exists()

    def build(self, code: str, began: float) -> Build:
        """Build (or fetch from the cache) the extensions a candidate compiles at import time."""
        start = time.monotonic()
        b = self._build(code)
        b.wall_s, b.started_s = time.monotonic() - start, start - began
        return b

    def _build(self, code: str) -> Build:
        if self.platform.backend == "cpu" and (marker := cuda_marker(code)):
            return Build(None, False, Outcome.NEEDS_GPU.value, f"CUDA code ({marker}) on the CPU backend: not built "
                         "and not counted against Exec; evaluate it on a GPU (--backend cuda), or write a C++ "
                         "extension (load_inline with cpp_sources only)")
        key, final = self._entry(code)
        if (cached := _cached(final)) is not None:
            return cached
        # one build of a program at a time across every process on this cache (a reward service beside `dice
        # eval`, two test workers): whoever waited finds the other's build in the cache
        locks = self.config.cache_dir / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / key, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cached = _cached(final)
            return cached if cached is not None else self._build_uncached(code, key, final)

    def _build_uncached(self, code: str, key: str, final: Path) -> Build:
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key[:16]}-", dir=final.parent))
        timeout_s = self.config.build.timeout_s

        def job(workdir: Path) -> BuildJob:
            return BuildJob(workdir=str(workdir), device=self.platform.backend,
                            limits=self.workers.limits(workdir, writable_build=str(staging)),
                            candidate_path=str(workdir / "candidate.py"), build_dir=str(staging),
                            **self.acceleration.job_fields())

        rep = self.workers.run_job("build", job, task_code=None, code=code, timeout_s=timeout_s)
        res = rep.result
        cleanup(rep.workdir)
        if res is None:
            kind, error = death_outcome(rep.exit, self.config, phase="build", timeout_s=timeout_s)
            shutil.rmtree(staging, ignore_errors=True)
            return Build(None, False, kind.value, error)  # not cached: deaths may be transient
        ok = res["status"] == "ok"
        entry = {"ok": ok, "kind": res.get("kind", ""), "error": res.get("error", ""),
                 "compile_s": res.get("compile_s", 0.0), "built": res.get("built", []),
                 "shortcuts": res.get("build_shortcuts", [])}
        if ok or entry["kind"] == Outcome.COMPILE_ERROR.value:  # deterministic results are cached
            (staging / "manifest.json").write_text(json.dumps(entry))
            try:
                os.replace(staging, final)
            except OSError:  # another process finished the same build first
                shutil.rmtree(staging, ignore_errors=True)
            return Build(final, ok, entry["kind"], entry["error"], entry["compile_s"], shortcuts=entry["shortcuts"])
        shutil.rmtree(staging, ignore_errors=True)
        return Build(None, ok, entry["kind"], entry["error"], entry["compile_s"], shortcuts=entry["shortcuts"])

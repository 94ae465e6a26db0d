"""Whether a bare CUDA build's compile error would be torch's own build's too. The bare attempt compiles CUDA sources
that name nothing of torch with an empty `torch/types.h`; when it fails, a second bare attempt includes the non-torch
headers `torch/types.h` pulls in under nvcc (`Surroundings.headers`: the standard library, cuda_fp16.h,
thrust/complex.h, ...). Sources that then still fail and use none of torch's macros (`Surroundings.macros`) would
fail under torch's header as well, so torch's build need not run: a demo-world unit that does not compile costs
~2.4 s of nvcc instead of ~9.4 (benchmarks/bare_cuda_build.py). The parent measures the surroundings once per torch
and nvcc (`store`)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from dice_kernels.harness.compiling.light_headers import uses_torch_outside_namespaces
from dice_kernels.harness.compiling.speed import torch_ninja_values

_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*[<\"]([^>\"]+)[>\"]", re.MULTILINE)


@dataclass(frozen=True)
class Surroundings:
    headers: tuple[str, ...]  # what torch/types.h's own files include from outside torch, as they spell it
    macros: frozenset[str]  # the macros torch/types.h defines that those headers alone do not

    def stub(self) -> str:
        """The second bare attempt's `torch/types.h`."""
        return "// dice-kernels: what torch/types.h includes from outside torch (harness/compiling/bare_cuda.py)\n" + (
            "".join(f"#include <{h}>\n" for h in self.headers))


def torch_nvcc() -> str | None:
    """The nvcc command torch's ninja file runs: PYTORCH_NVCC, else CUDA_HOME's; None without CUDA."""
    import torch.utils.cpp_extension as cpp

    if os.environ.get("PYTORCH_NVCC"):
        return os.environ["PYTORCH_NVCC"]
    return str(Path(cpp.CUDA_HOME) / "bin" / "nvcc") if cpp.CUDA_HOME else None


@cache
def nvcc_flags() -> tuple[str, ...]:
    """The flags of torch's CUDA units that change what a header declares (its macros, the C++ standard), as its
    ninja file gives them; where torch cannot write one (a CPU build of torch: tests), its common nvcc flags and
    the standard of this torch's C++ units."""
    import torch.utils.cpp_extension as cpp

    with tempfile.TemporaryDirectory(prefix="dice-bare-cuda-") as tmp:
        try:
            values = torch_ninja_values(Path(tmp), [str(Path(tmp) / "main.cpp"), str(Path(tmp) / "cuda.cu")],
                                        with_cuda=True)
            flags = shlex.split(values["cuda_cflags"]) + shlex.split(values.get("cuda_post_cflags", ""))
        except Exception:  # noqa: BLE001 - torch's internals raise what they raise without CUDA
            values = torch_ninja_values(Path(tmp), [str(Path(tmp) / "main.cpp")])
            flags = [*cpp.COMMON_NVCC_FLAGS, "-DTORCH_API_INCLUDE_EXTENSION_H",
                     *(f for f in shlex.split(values.get("cflags", "")) if f.startswith("-std="))]
    kept = [f for f in flags if f.startswith(("-D", "-U", "-std=", "--expt-")) and "TORCH_EXTENSION_NAME" not in f]
    return (*kept, "-x", "cu")


def _nvcc(command: list[str]) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _macros(nvcc: str, unit: Path, include_dirs: list[str]) -> set[str] | None:
    out = _nvcc([nvcc, *nvcc_flags(), "-E", "-Xcompiler", "-dM", *(f"-I{d}" for d in include_dirs), str(unit)])
    return None if out is None else {m.group(1) for m in re.finditer(r"^#define (\w+)", out, re.MULTILINE)}


def outside_headers(torch_files: list[Path], outside_files: list[str], torch_dirs: list[Path]) -> tuple[str, ...]:
    """The include names torch's files use for files outside torch that nvcc actually opened (a header torch includes
    only for another platform, `hip/hip_runtime.h`, is left out)."""
    opened = {os.path.normpath(f) for f in outside_files}
    names = set()
    for path in torch_files:
        for name in _INCLUDE.findall(path.read_text(errors="replace")):
            if any((d / name).exists() for d in (*torch_dirs, path.parent)):
                continue  # one of torch's own
            if any(f.endswith("/" + os.path.normpath(name)) for f in opened):
                names.add(name)
    return tuple(sorted(names))


def measure(nvcc: str, include_dirs: list[str] | None = None) -> Surroundings | None:
    """torch/types.h's surroundings under `nvcc` (three preprocessor runs, ~9 s), or None when nvcc cannot run."""
    import torch.utils.cpp_extension as cpp

    include_dirs = include_dirs or cpp.include_paths()
    torch_dirs = [Path(d).resolve() for d in include_dirs]
    with tempfile.TemporaryDirectory(prefix="dice-bare-cuda-") as tmp:
        unit = Path(tmp) / "probe.cu"
        unit.write_text("#include <torch/types.h>\n")
        deps = _nvcc([nvcc, *nvcc_flags(), "-M", *(f"-I{d}" for d in include_dirs), str(unit)])
        if deps is None:
            return None
        files = {t: Path(t).resolve() for t in deps.replace("\\\n", " ").split()
                 if not t.endswith(":") and t != str(unit)}
        inside = {f: r for f, r in files.items() if any(r.is_relative_to(d) for d in torch_dirs)}
        headers = outside_headers(list(inside.values()), [f for f in files if f not in inside], torch_dirs)
        torch_macros = _macros(nvcc, unit, include_dirs)
        (Path(tmp) / "stub" / "torch").mkdir(parents=True)
        (Path(tmp) / "stub" / "torch" / "types.h").write_text(Surroundings(headers, frozenset()).stub())
        stub_macros = _macros(nvcc, unit, [str(Path(tmp) / "stub")])
    if torch_macros is None or stub_macros is None:
        return None
    return Surroundings(headers, frozenset(torch_macros - stub_macros))


@cache  # every batch asks (an RL step is one)
def _version(nvcc: str) -> str:
    return _nvcc([nvcc, "--version"]) or nvcc


def surroundings_file(cache_dir: Path, nvcc: str) -> Path:
    """Where the parent stores the surroundings for this torch (its version, include folders and the time its
    torch/types.h was written: a reinstall of one version can change them) and this nvcc."""
    import torch
    from torch.utils.cpp_extension import include_paths

    folders = include_paths()
    header = next((h for h in (Path(d) / "torch" / "types.h" for d in folders) if h.is_file()), None)
    written = header.stat().st_mtime_ns if header else None
    key = hashlib.sha256(json.dumps([torch.__version__, folders, written, _version(nvcc)]).encode()).hexdigest()
    return cache_dir / "pch" / f"torch-cuda-surroundings-{key[:24]}.json"


def store(path: Path, nvcc: str) -> None:
    """Measure and write the surroundings to `path` once (workers only read it); nothing when nvcc cannot run."""
    if path.exists() or (found := measure(nvcc)) is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(json.dumps({"headers": list(found.headers), "macros": sorted(found.macros)}))
    os.replace(staging, path)


def load(path: str | None) -> Surroundings | None:
    """The stored surroundings, or None (not measured yet, or unreadable)."""
    try:
        data = json.loads(Path(path).read_text()) if path else None
        return Surroundings(tuple(data["headers"]), frozenset(data["macros"])) if data else None
    except (OSError, ValueError, TypeError, KeyError):
        return None


def failure_is_final(cuda_sources, surroundings: Surroundings) -> bool:
    """Whether a bare attempt with `surroundings.stub()` that failed would fail under torch's header too: the sources
    name nothing of torch (the bare attempt's condition) and none of its macros or global names."""
    return not uses_torch_outside_namespaces(cuda_sources, surroundings.macros)

"""Lighter torch headers for a `load_inline` build, none of which changes what the candidate's code means: no torch
header at all for CUDA sources that name nothing of torch (`bare_cuda_arguments`), the CUDA unit without
`#include <torch/extension.h>` (`light_cuda_sources`), ATen's umbrella headers cut to the operators
the sources name (`lean_cuda_arguments`), and a `torch/extension.h` without the C++ frontend for a `main.cpp`
whose sources only declare functions (`light_extension_header`, `declarations_only`). A build tries them first
and falls back to the candidate's own sources (compiling/in_sandbox.py); compiling/speed.py precompiles the headers."""

from __future__ import annotations

import re
from pathlib import Path


_ALL_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<torch/all\.h>[ \t]*\n", re.MULTILINE)
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
# `T name(params)`: a function declaration with no call, body, string or character in it (default arguments are
# allowed when they call nothing)
_DECLARATION = re.compile(r"[\w:<>,\s*&]*[\w>*&][\s*&]+\w+\s*\([^(){}\"';]*\)\s*(?:const\s*)?")
_EXTENSION_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<torch/extension\.h>[ \t]*$", re.MULTILINE)
# the namespaces and the class a CUDA unit or a bare C++ module names when it uses torch (its macros, TORCH_CHECK and
# the like, fail to compile without the header, so the build falls back)
TORCH_NAMES = re.compile(r"\b(torch|at|c10|caffe2|Tensor)\b")
_NEEDS_BINDINGS = re.compile(r"PYBIND11|\bpy::|\btorch::(nn|optim|jit|data|fft|linalg|special|autograd)::")


def strip_comments(text: str) -> str:
    """C/C++ `text` with every comment replaced by a space."""
    return _COMMENT.sub(" ", text)


def source_texts(sources) -> list[str]:
    return [sources] if isinstance(sources, str) else list(sources or [])


def needs_full_header(sources) -> bool:
    """Whether the code visibly uses what only <torch/extension.h> declares (Python bindings, the C++ frontend):
    no lighter header is tried for it."""
    return any(_NEEDS_BINDINGS.search(t) for t in source_texts(sources))


def light_cuda_sources(sources) -> list[str] | None:
    """`sources` without `#include <torch/extension.h>`, or None when nothing would change or the code
    visibly needs what only that header declares."""
    texts = source_texts(sources)
    if not any(_EXTENSION_INCLUDE.search(t) for t in texts) or needs_full_header(texts):
        return None
    return [_EXTENSION_INCLUDE.sub("// <torch/extension.h>: torch/types.h above declares what kernels use", t)
            for t in texts]


def bare_cuda_sources(sources) -> bool:
    """Whether there are CUDA sources and none of them names torch (comments aside): what the bare attempts take
    (`bare_cuda_arguments`; with bindings that take scalars, bare_cpp.py builds main.cpp without torch too)."""
    return bool(sources) and not any(TORCH_NAMES.search(strip_comments(t)) for t in source_texts(sources))


def cuda_unit_text(sources, no_implicit_headers: bool = False) -> str:
    """The `cuda.cu` torch's `load_inline` writes for `sources`: its three include lines (unless
    `no_implicit_headers`), then the sources."""
    implicit = [] if no_implicit_headers else ["#include <torch/types.h>", "#include <cuda.h>",
                                               "#include <cuda_runtime.h>"]
    return "\n".join([*implicit, *source_texts(sources)])


_EMPTY_TYPES_H = "// dice-kernels: these CUDA sources name nothing of torch (harness/compiling/light_headers.py)\n"


def bare_cuda_arguments(arguments: dict, include_dir: Path, header: str = _EMPTY_TYPES_H) -> dict | None:
    """`load_inline` arguments for the bare attempt, or None: CUDA sources that name nothing of torch (comments
    aside) compile with an empty header under `include_dir` found for the `#include <torch/types.h>` load_inline
    puts at their top, so nvcc parses the kernels and CUDA's headers only (~1 s against ~25 s). Code that compiles
    without torch's declarations names none of them, so they cannot change what it means; code that uses torch
    anyway fails to compile and the build falls back to the candidate's own sources. `header`: that torch/types.h's
    text (compiling/bare_cuda.py's wider stub for the second bare attempt)."""
    if not bare_cuda_sources(arguments.get("cuda_sources")):
        return None
    stub = include_dir / "torch" / "types.h"
    stub.parent.mkdir(parents=True, exist_ok=True)
    stub.write_text(header)
    return {**arguments, "extra_cuda_cflags": [*(arguments.get("extra_cuda_cflags") or []), f"-I{include_dir}"]}


def light_extension_header(text: str) -> str | None:
    """torch's `torch/extension.h` text without the C++ frontend (its `#include <torch/all.h>`), or None when that
    include is not there exactly once."""
    light, n = _ALL_INCLUDE.subn("", text)
    return light if n == 1 else None


def declarations_only(sources) -> bool:
    """Whether cpp_sources only declare functions (`T name(params);`, comments and preprocessor lines aside). Such
    code calls nothing and defines nothing, so the light header gives it the same meaning: a type it names from
    the frontend is not declared there and fails to compile."""
    for text in source_texts(sources):
        code = "\n".join(line for line in strip_comments(text).splitlines() if not line.lstrip().startswith("#"))
        if any(c in code for c in "{}\"'\\"):
            return False
        if not all(_DECLARATION.fullmatch(s.strip()) for s in code.split(";") if s.strip()):
            return False
    return True


_OPS_INCLUDE = {  # ATen umbrella header -> its per-operator include lines (group 1: the operator's name)
    "Functions.h": re.compile(r"^[ \t]*#[ \t]*include[ \t]*<ATen/ops/(\w+)\.h>[ \t]*$", re.MULTILINE),
    "NativeFunctions.h": re.compile(r"^[ \t]*#[ \t]*include[ \t]*<ATen/ops/(\w+)_native\.h>[ \t]*$", re.MULTILINE),
}
IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
# torch's names at global scope that are not macros: pybind11's namespace and the Python bindings' THP* functions
_TORCH_GLOBALS = re.compile(r"\bpybind11\b|\bTHP\w*")


def uses_torch_outside_namespaces(sources, macros: frozenset[str]) -> bool:
    """Whether code (comments aside) uses one of torch's `macros` or its global names: all that torch's header could
    declare for sources that name none of its namespaces, so a bare build's compile error is final without them."""
    code = "\n".join(strip_comments(t) for t in source_texts(sources))
    return bool(_TORCH_GLOBALS.search(code) or set(IDENTIFIER.findall(code)) & macros)


def lean_umbrella(text: str, pattern: re.Pattern, names: set[str]) -> str:
    """An umbrella header's text with only the per-operator includes whose operator is in `names` or is named by
    the umbrella's own code (Functions.h defines a few overloads, such as `at::var(self, int dim)`, on top of
    the operators': leaving their operators out would change which overload a call picks)."""
    own = set(IDENTIFIER.findall(pattern.sub("", text)))
    return pattern.sub(lambda m: m.group(0) if m.group(1) in names or m.group(1) in own else "", text)


def lean_aten_headers(sources, out_dir: Path, aten_dir: Path | None = None) -> list[str] | None:
    """Write the lean umbrella headers for CUDA `sources` under `out_dir/ATen`; returns the extra CUDA flags that
    use them, or None when torch's umbrellas are not where expected. Every identifier in the sources counts
    as a name (comments and strings too: an extra operator costs a little time, never a changed meaning)."""
    if aten_dir is None:
        import torch

        aten_dir = Path(torch.__file__).parent / "include" / "ATen"
    names = {n for t in source_texts(sources) for n in IDENTIFIER.findall(t)}
    try:
        umbrellas = {name: (aten_dir / name).read_text() for name in _OPS_INCLUDE}
    except OSError:
        return None
    (out_dir / "ATen").mkdir(parents=True, exist_ok=True)
    for name, text in umbrellas.items():
        (out_dir / "ATen" / name).write_text(lean_umbrella(text, _OPS_INCLUDE[name], names))
    return ["-DAT_PER_OPERATOR_HEADERS", f"-I{out_dir}"]


def lean_cuda_arguments(arguments: dict, include_dir: Path) -> dict | None:
    """`load_inline` arguments for the lean attempt: the light CUDA sources (the candidate's own where there is no
    include to drop), with the lean umbrellas written under `include_dir` and the flags that use them; None when
    there are no CUDA sources, the code needs the full header, or torch's umbrellas are not found."""
    sources = arguments.get("cuda_sources")
    if not sources or needs_full_header(sources):
        return None
    light = light_cuda_sources(sources)
    lighter = sources if light is None else light
    flags = lean_aten_headers(lighter, include_dir)
    if flags is None:
        return None
    return {**arguments, "cuda_sources": lighter,
            "extra_cuda_cflags": [*(arguments.get("extra_cuda_cflags") or []), *flags]}

"""The bare C++ build: a C++-only `load_inline` whose sources name nothing of torch and whose bound functions take and
return scalars (a kernel launcher's addresses and sizes) compiled as a plain CPython extension, the C API's argument
parsing in place of pybind11's and no torch header (~1.6 s of a core against ~13.5 s), and when its compile error is
final (torch's header could not have mended it). A CUDA module whose CUDA sources name nothing of torch either is
built the same way, its CUDA unit with the bare CUDA attempt's empty `torch/types.h` (light_headers.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from dice_kernels.harness.compiling.light_headers import (TORCH_NAMES, bare_cuda_arguments, bare_cuda_sources,
                                                          cuda_unit_text, needs_full_header, source_texts,
                                                          strip_comments, uses_torch_outside_namespaces)

# what a scalar C++ type is received as from Python: (PyArg_ParseTuple format, the C variable it fills, how a
# returned value becomes a Python object). pybind11's casters refuse a float for an integer and accept an int for a
# float, as these formats do.
_INTEGER = ("L", "long long", "PyLong_FromLongLong")
_SCALARS = {
    **dict.fromkeys(("int64_t", "long", "long int", "long long", "long long int", "ptrdiff_t", "intptr_t"), _INTEGER),
    **dict.fromkeys(("int", "int32_t"), ("i", "int", "PyLong_FromLong")),
    "float": ("f", "float", "PyFloat_FromDouble"),
    "double": ("d", "double", "PyFloat_FromDouble"),
    "bool": ("p", "int", "PyBool_FromLong"),
}
_QUALIFIERS = re.compile(r"\b(?:const|static|inline|extern|std::)\s*|::")
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'')

# every standard and system header torch/extension.h includes beyond Python.h's (GCC 12, x86-64, torch 2.13; and
# Python's frameobject.h), so that code naming nothing of torch sees the same declarations (which overload
# `abs(float)` picks, an intrinsic, a POSIX call) as under torch's header; one the compiler lacks is left out
# (`__has_include`). A test compares the files the stub pulls in with those torch's header pulls in.
SYSTEM_HEADERS = ("cxxabi.h", "frameobject.h", "immintrin.h", "x86intrin.h", "libintl.h", "locale.h", "semaphore.h",
                  "sys/single_threaded.h", "sys/syscall.h", "wctype.h")
STANDARD_HEADERS = (
    "algorithm array atomic bit bitset cassert cctype cerrno chrono climits clocale cmath compare complex concepts "
    "condition_variable cstddef cstdint cstdio cstdlib cstring ctime cwchar cwctype deque exception forward_list "
    "functional initializer_list iomanip ios iosfwd iostream istream iterator limits list locale map memory mutex new "
    "numbers numeric optional ostream queue ranges ratio semaphore set span sstream stack stdexcept stop_token "
    "streambuf string string_view system_error thread tuple type_traits typeindex typeinfo unordered_map "
    "unordered_set utility valarray variant vector version").split()


@dataclass(frozen=True)
class ScalarFunction:
    """A function the module binds: its name, docstring, parameter types and return type (normalised: `int64_t`,
    `double`, ...; "void" returns None)."""

    name: str
    doc: str
    params: tuple[str, ...]
    returns: str


def _scalar_type(text: str) -> str | None:
    """The normalised name of a scalar type as written (`const std::int64_t` -> `int64_t`), or None."""
    name = " ".join(_QUALIFIERS.sub(" ", text).split())
    return name if name in _SCALARS or name == "void" else None


def _parameter_types(text: str) -> tuple[str, ...] | None:
    """The types of a parameter list (`int64_t x, const float scale = 1`), or None when one is not a scalar."""
    text = text.strip()
    if text in ("", "void"):
        return ()
    types = []
    for param in text.split(","):
        declared = param.split("=")[0].split()
        # `T name` or an unnamed `T`: the name is the last word unless the whole text is a type
        kind = _scalar_type(" ".join(declared)) or _scalar_type(" ".join(declared[:-1]))
        if kind is None or kind == "void":
            return None
        types.append(kind)
    return tuple(types)


def _signatures(code: str, name: str) -> set[tuple[str, tuple[str, ...]]]:
    """(return type, parameter types) of every declaration or definition of `name` in `code`; a signature that is
    not all scalars comes out as ("", ()) so that the function is refused. Calls (`return f(...)`, `y = f(...)`)
    are not declarations and are skipped."""
    found = set()
    for match in re.finditer(rf"\b{re.escape(name)}\s*\(([^()]*)\)\s*([{{;]?)", code):
        before = re.split(r"[;{}]|^\s*#[^\n]*$", code[:match.start()], flags=re.MULTILINE)[-1]
        returns = _scalar_type(before)
        if returns is None and (not before.strip() or re.search(r"\breturn\b|[=(,.?!+\-/|]", before)):
            continue  # a call, or the name in an expression
        params = _parameter_types(match.group(1))
        declared = returns is not None and params is not None and match.group(2)
        found.add((returns, params) if declared else ("", ()))
    return found


def scalar_functions(arguments: dict, cuda: bool = False) -> list[ScalarFunction] | None:
    """The functions a bare C++ build binds for these `load_inline` arguments, or None when it does not apply: CUDA
    sources (with `cuda`: none, or one that names torch, `light_headers.bare_cuda_sources`; or `with_cuda=False`),
    SYCL sources, no `functions` (the sources bind themselves), a name that is not an identifier, a cpp source that
    names torch or needs pybind11, or a function not declared in the cpp sources with one signature of scalar types
    only."""
    if cuda:
        if not bare_cuda_sources(arguments.get("cuda_sources")) or arguments.get("with_cuda") is False:
            return None
    elif arguments.get("cuda_sources") or arguments.get("with_cuda"):
        return None
    if arguments.get("sycl_sources") or arguments.get("with_sycl"):
        return None
    if not arguments.get("is_python_module", True) or arguments.get("use_pch"):
        return None
    functions, name = arguments.get("functions"), str(arguments.get("name", ""))
    if functions is None or not (name.isidentifier() and name.isascii()):
        return None
    if isinstance(functions, str):
        functions = [functions]
    docs = dict(functions) if isinstance(functions, dict) else {f: f for f in functions}
    texts = source_texts(arguments.get("cpp_sources"))
    if needs_full_header(texts):
        return None
    code = "\n".join(_STRING.sub('""', strip_comments(t)) for t in texts)
    if TORCH_NAMES.search(code):
        return None
    bound = []
    for function, doc in docs.items():
        if not (isinstance(function, str) and function.isidentifier() and function.isascii()):
            return None
        signatures = _signatures(code, function)
        if len(signatures) != 1 or not next(iter(signatures))[0]:
            return None
        returns, params = next(iter(signatures))
        bound.append(ScalarFunction(function, str(doc), params, returns))
    return bound or None


def _c_string(text: str) -> str:
    """`text` as a C string literal (every byte that is not an ASCII letter, digit or space as an octal escape)."""
    return '"' + "".join(chr(b) if (chr(b).isascii() and chr(b).isalnum()) or b == 32 else f"\\{b:03o}"
                         for b in text.encode()) + '"'


def bindings(module: str, functions: list[ScalarFunction]) -> str:
    """The C API module definition appended to the sources, as `load_inline` appends its PYBIND11_MODULE: each
    function parses its positional arguments, calls the C++ function, turns a C++ exception into RuntimeError
    (as torch's bindings do) and returns its result."""
    wrappers, table = [], []
    for f in functions:
        receive = [_SCALARS[t] for t in f.params]
        names = [f"a{i}" for i in range(len(receive))]
        lines = [f"static PyObject* dice_bare_{f.name}(PyObject*, PyObject* args) {{"]
        lines += [f"    {c_type} {n};" for (_, c_type, _), n in zip(receive, names)]
        targets = "".join(f", &{n}" for n in names)
        formats = "".join(fmt for fmt, _, _ in receive)
        lines.append(f'    if (!PyArg_ParseTuple(args, "{formats}:{f.name}"{targets})) return nullptr;')
        call = f"{f.name}({', '.join(names)})"
        done = "Py_RETURN_NONE;" if f.returns == "void" else f"return {_SCALARS[f.returns][2]}(result);"
        statement = f"{call};" if f.returns == "void" else f"auto result = {call};"
        lines += [
            f"    try {{ {statement} {done} }}",
            "    catch (const std::exception& e) { PyErr_SetString(PyExc_RuntimeError, e.what()); }",
            '    catch (...) { PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception"); }',
            "    return nullptr;",
            "}"]
        wrappers.append("\n".join(lines))
        table.append(f"    {{{_c_string(f.name)}, dice_bare_{f.name}, METH_VARARGS, {_c_string(f.doc)}}},")
    return "\n\n".join([
        *wrappers,
        "static PyMethodDef dice_bare_methods[] = {\n" + "\n".join(table) + "\n    {nullptr, nullptr, 0, nullptr}};",
        # torch's load compiles with -DTORCH_EXTENSION_NAME=<the name it imports>: `module`, or `module_v1`, ...
        # for a later module of that name with other sources in one process
        f"#ifndef TORCH_EXTENSION_NAME\n#define TORCH_EXTENSION_NAME {module}\n#endif",
        "#define DICE_BARE_JOIN(a, b) a##b\n#define DICE_BARE_INIT(name) DICE_BARE_JOIN(PyInit_, name)\n"
        "#define DICE_BARE_QUOTE(name) #name\n#define DICE_BARE_NAME(name) DICE_BARE_QUOTE(name)",
        "static PyModuleDef dice_bare_module = {PyModuleDef_HEAD_INIT, DICE_BARE_NAME(TORCH_EXTENSION_NAME), "
        "nullptr, -1, dice_bare_methods};",
        "PyMODINIT_FUNC DICE_BARE_INIT(TORCH_EXTENSION_NAME)() { return PyModule_Create(&dice_bare_module); }"])


def stub_header() -> str:
    """What the bare build's `torch/extension.h` holds: Python's header and the standard and system headers torch's
    includes."""
    guarded = (f"#if __has_include(<{h}>)\n#include <{h}>\n#endif" for h in (*SYSTEM_HEADERS, *STANDARD_HEADERS))
    return "// dice-kernels: the sources name nothing of torch (harness/compiling/bare_cpp.py)\n#include <Python.h>\n" + (
        "\n".join(guarded) + "\n")


def write_stub(include_dir: Path) -> Path:
    """`stub_header()` as `include_dir/torch/extension.h`, found first with `-I include_dir`; returns include_dir."""
    (include_dir / "torch").mkdir(parents=True, exist_ok=True)
    (include_dir / "torch" / "extension.h").write_text(stub_header())
    return include_dir


def bare_load_arguments(name: str, cpp_sources, functions=None, extra_cflags=None, extra_ldflags=None,
                        extra_include_paths=None, build_directory=None, no_implicit_headers=False,
                        stub_dir: str | None = None, cuda_sources=None, extra_cuda_cflags=None, **arguments) -> dict:
    """torch's `load` arguments for a bare build of these `load_inline` arguments (what `scalar_functions` accepts,
    with `cuda` where there are CUDA sources), its sources written into the build directory as torch would write
    them: main.cpp (its header line, the sources) with the C API bindings in place of pybind11's, and cuda.cu
    (`light_headers.cuda_unit_text`) whose `#include <torch/types.h>` finds the bare CUDA attempt's empty header.
    main.cpp finds the stub header first: at `stub_dir` where the harness has published it there with its
    precompiled form (compiling/speed.py; the same text), else written into the build directory. Raises ValueError
    where the bare build does not apply."""
    cuda = bool(cuda_sources)
    bound = scalar_functions({"name": name, "cpp_sources": cpp_sources, "functions": functions,
                              "cuda_sources": cuda_sources, **arguments}, cuda=cuda)
    if bound is None:
        raise ValueError(f"extension {name!r} is not a bare C++ build (harness/compiling/bare_cpp.py)")
    directory = Path(build_directory)
    published = stub_dir is not None and (Path(stub_dir) / "torch" / "extension.h").is_file()
    include = Path(stub_dir) if published else write_stub(directory / "bare_include")
    texts = ([] if no_implicit_headers else ["#include <torch/extension.h>"]) + source_texts(cpp_sources)
    main = directory / "main.cpp"
    main.write_text("\n".join([*texts, bindings(name, bound)]) + "\n")
    sources = [str(main)]
    if cuda:
        unit = directory / "cuda.cu"
        unit.write_text(cuda_unit_text(cuda_sources, no_implicit_headers))
        sources.append(str(unit))
        bare = bare_cuda_arguments({"cuda_sources": cuda_sources, "extra_cuda_cflags": extra_cuda_cflags},
                                   directory / "bare_include")
        extra_cuda_cflags = bare["extra_cuda_cflags"]
    return {"name": name, "sources": sources, "extra_cflags": extra_cflags, "extra_cuda_cflags": extra_cuda_cflags,
            "extra_ldflags": extra_ldflags, "extra_include_paths": [str(include), *(extra_include_paths or [])],
            "build_directory": str(directory), "verbose": False, "with_cuda": cuda}


def build_bare_cpp(name: str, cpp_sources, functions=None, *, load=None, **arguments):
    """`load_inline` for what `scalar_functions` accepts (with CUDA sources: with `cuda`): torch's `load` (`load`:
    torch's own where the harness has patched the module's) builds and imports what `bare_load_arguments` writes,
    with torch's compiler, flags, CUDA arch list and link. Raises what torch raises when it does not build (the
    build then falls back to torch's own)."""
    if load is None:
        from torch.utils.cpp_extension import load

    return load(**bare_load_arguments(name, cpp_sources, functions, **arguments))


def _macro_names(header_text: str, include_dirs: list[str]) -> set[str] | None:
    """The names of the macros defined after `header_text` is preprocessed (`c++ -dM -E`), or None on failure."""
    import torch.utils.cpp_extension as cpp

    command = [cpp.get_cxx_compiler(), "-dM", "-E", "-std=c++20", "-x", "c++", "-", *(f"-I{d}" for d in include_dirs)]
    try:
        done = subprocess.run(command, input=header_text, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return {m.group(1) for m in re.finditer(r"^#define (\w+)", done.stdout, re.MULTILINE)}


@cache
def torch_macro_names() -> frozenset[str] | None:
    """The macros torch/extension.h defines that the stub does not (~670 with torch 2.13: TORCH_CHECK,
    AT_DISPATCH_..., CHECK, ...), read from both through the preprocessor (~2 s once per process, on this 2-core
    machine); None when it cannot run."""
    import torch.utils.cpp_extension as cpp

    python = sysconfig.get_path("include")
    with tempfile.TemporaryDirectory(prefix="dice-bare-") as tmp:
        stub = _macro_names("#include <torch/extension.h>\n", [str(write_stub(Path(tmp))), python])
    torch = _macro_names("#include <torch/extension.h>\n", [*cpp.include_paths(), python])
    return None if stub is None or torch is None else frozenset(torch - stub)


def read_macro_names(path: str | None) -> frozenset[str] | None:
    """`torch_macro_names` as the harness stored them (compiling/speed.py's `store_torch_macros`), or None."""
    try:
        return frozenset(json.loads(Path(path).read_text())) if path else None
    except (OSError, ValueError, TypeError):
        return None


def bare_failure_is_final(cpp_sources, stored_macros: str | None = None) -> bool:
    """Whether a bare C++ build that failed to compile would fail under torch's header too, so that torch's own build
    need not run: the stub declares everything the standard and system headers under torch's declare, and the
    sources (which name nothing of torch's namespaces) use none of torch's macros and none of its global names.
    torch's macro names come from `stored_macros` where the harness has stored them, else from the preprocessor.
    False when they cannot be read."""
    macros = read_macro_names(stored_macros) or torch_macro_names()
    if macros is None:
        return False
    return not uses_torch_outside_namespaces(cpp_sources, macros)

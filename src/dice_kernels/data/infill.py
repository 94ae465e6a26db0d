r'''The infilling cut of a `load_inline` program: prefix / core / suffix.

core = the whole top-level `source = """..."""` assignment whose variable `load_inline` receives as
`cuda_sources` (else `cpp_sources`); prefix = everything before it; suffix = everything after it.
`prefix + core + suffix` is always the program, byte for byte.
'''

from __future__ import annotations

import ast
import re
from dataclasses import dataclass


_LINE_RE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$")


class InfillError(ValueError):
    """The program has no single string-literal kernel source to cut out; the message says why."""


@dataclass(frozen=True)
class InfillSplit:
    prefix: str
    core: str
    suffix: str
    variable: str  # the name bound to the kernel source string

    @property
    def program(self) -> str:
        return self.prefix + self.core + self.suffix


def _load_inline_source_names(tree: ast.Module) -> list[str]:
    """Names passed as cuda_sources (preferred) or cpp_sources to any `load_inline(...)` call, in that order."""
    cuda, cpp = [], []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name != "load_inline":
            continue
        for kw in node.keywords:
            values = kw.value.elts if isinstance(kw.value, (ast.List, ast.Tuple)) else [kw.value]
            names = [v.id for v in values if isinstance(v, ast.Name)]
            if kw.arg == "cuda_sources":
                cuda.extend(names)
            elif kw.arg == "cpp_sources":
                cpp.extend(names)
    return cuda or cpp  # a cpp_sources string is the core only in C++-only programs


def _offset(lines: list[str], lineno: int, col: int) -> int:
    """Character offset of an ast (1-based line, UTF-8 byte column) position in the joined `lines`."""
    before = sum(len(line) for line in lines[: lineno - 1])
    return before + len(lines[lineno - 1].encode()[:col].decode())


def split_program(code: str) -> InfillSplit:
    """Cut a `load_inline` program into prefix / core / suffix (raises InfillError when it cannot)."""
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        raise InfillError(f"program does not parse (line {e.lineno}: {e.msg})") from None
    names = _load_inline_source_names(tree)
    if not names:
        raise InfillError("no load_inline call with cuda_sources/cpp_sources bound to a variable")
    # The kernel source is a top-level assignment of one string literal; the last binding before use wins.
    assigns = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            assigns[node.targets[0].id] = node
    for name in names:
        if name in assigns:
            node = assigns[name]
            lines = _LINE_RE.findall(code)  # ast's notion of lines; str.splitlines also splits on \f etc.
            start = _offset(lines, node.lineno, node.col_offset)
            end = _offset(lines, node.end_lineno, node.end_col_offset)
            return InfillSplit(code[:start], code[start:end], code[end:], name)
    raise InfillError(f"load_inline sources {names} are not top-level string-literal assignments")

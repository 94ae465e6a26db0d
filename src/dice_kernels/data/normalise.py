"""Code normalisation shared by deduplication and decontamination: one token stream per program.

Comments, docstrings, whitespace and numeric literals are dropped or replaced, so two programs that differ
only in formatting, comments or tensor sizes give the same tokens. CUDA/C++ source held in Python string
literals is tokenised as C (with `//` and `/* */` comments removed), so kernels compare token by token.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize

NUM = "<num>"
_TOKEN_RE = re.compile(r"[A-Za-z_]\w*|\d[\w.]*|\.\d[\w.]*|\S")
_NUMBER_RE = re.compile(r"^\.?\d")
_C_COMMENT_RE = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
_PY_COMMENT_RE = re.compile(r"#(?!include|define|pragma|if|endif|else|undef)[^\n]*")


def _word_tokens(text: str) -> list[str]:
    return [NUM if _NUMBER_RE.match(t) else t for t in _TOKEN_RE.findall(text)]


def _docstring_starts(tree: ast.AST) -> set[tuple[int, int]]:
    """(line, col) of every docstring literal: module, class and function docstrings carry no semantics."""
    starts = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                starts.add((first.lineno, first.col_offset))
    return starts


def _string_body(token: str) -> str:
    """The text inside a Python string literal token (prefixes and quotes removed, escapes left as written)."""
    i = 0
    while token[i] not in "'\"":
        i += 1
    quote = token[i : i + 3] if token[i : i + 3] in ('"""', "'''") else token[i]
    return token[i + len(quote) : len(token) - len(quote)]


def code_tokens(code: str) -> list[str]:
    """Normalised tokens of a Python program, with embedded C/CUDA strings tokenised as C.

    Falls back to a regex pass for text that does not parse as Python (truncated or non-Python code), so
    every input gets a token stream.
    """
    try:
        docstrings = _docstring_starts(ast.parse(code))
        toks = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (SyntaxError, tokenize.TokenError, ValueError, IndentationError):
        return _word_tokens(_PY_COMMENT_RE.sub("", _C_COMMENT_RE.sub("", code)))
    out: list[str] = []
    for tok in toks:
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                        tokenize.ENDMARKER):
            continue
        if tok.type == tokenize.STRING:
            if tok.start in docstrings:
                continue
            out.extend(_word_tokens(_C_COMMENT_RE.sub("", _string_body(tok.string))))
        elif tok.type == tokenize.NUMBER:
            out.append(NUM)
        else:
            out.append(tok.string)
    return out


def ngrams(tokens: list[str], n: int) -> set[str]:
    """Distinct token n-grams joined by a space; a stream shorter than n yields one gram (itself)."""
    if len(tokens) < n:
        return {" ".join(tokens)} if tokens else set()
    return {" ".join(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}

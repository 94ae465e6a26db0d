"""Candidates: solution programs (a `.py` file, or raw model output from which the first fenced Python block
is extracted). Extraction is pure text processing; nothing here executes candidate code."""

from __future__ import annotations

import ast
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

_FENCE_RE = re.compile(r"```[ \t]*(?P<lang>[A-Za-z0-9_+-]*)[^\n]*\n(?P<body>.*?)(?P<close>```|\Z)", re.DOTALL)
_PY_LANGS = {"python", "py", "python3", ""}


@dataclass(frozen=True)
class Candidate:
    id: str  # unique within a run: usually the solution path, or "<task>#<sample>"
    code: str | None  # None when no code could be extracted -> generation_failure
    path: str = ""
    raw_sha256: str = ""  # hash of the text as given (file bytes or model output)
    problem: str = ""  # why `code` is None, or a note on truncation

    @property
    def sha256(self) -> str:
        return hashlib.sha256((self.code or "").encode()).hexdigest()

    @property
    def program_sha256(self) -> str:
        """Hash of the program's syntax tree: equal for candidates that differ only in comments or layout
        (string constants, hence CUDA sources, are part of the tree). The exact hash when it does not parse."""
        try:
            tree = ast.dump(ast.parse(self.code or ""), include_attributes=False)
        except (SyntaxError, ValueError):
            return self.sha256
        return hashlib.sha256(tree.encode()).hexdigest()


def extract_code(text: str) -> tuple[str | None, str]:
    """(code, problem) from model output: the first fenced python block, else the text itself if it is Python.

    A fence that opens but never closes means the generation was cut off: reported as truncated.
    """
    for m in _FENCE_RE.finditer(text):
        if m.group("lang").lower() not in _PY_LANGS:
            continue
        body = m.group("body")
        if not m.group("close"):
            return None, "generation truncated: a code block opens but never closes"
        if not body.strip():
            return None, "the first python code block is empty"
        return body, ""
    stripped = text.strip()
    if not stripped:
        return None, "no code: the output is empty"
    if "```" in stripped:
        return None, "no python code block in the output"
    if re.search(r"^\s*(import|from|class|def)\s", stripped, re.MULTILINE):
        return text, ""
    return None, "no code: the output contains no python code block and is not a python program"


def candidate_from_text(text: str, *, id: str, path: str = "") -> Candidate:
    code, problem = extract_code(text)
    return Candidate(id=id, code=code, path=path, raw_sha256=hashlib.sha256(text.encode()).hexdigest(),
                     problem=problem)


def load_candidate(path: str | Path, id: str | None = None) -> Candidate:
    """A solution file: `.py` files are taken as code; anything else (.md, .txt) as model output to extract from."""
    path = Path(path)
    text = path.read_text(errors="replace")
    cid = id or str(path)
    if path.suffix == ".py":
        return Candidate(id=cid, code=text if text.strip() else None, path=str(path),
                         raw_sha256=hashlib.sha256(text.encode()).hexdigest(),
                         problem="" if text.strip() else "no code: the solution file is empty")
    return candidate_from_text(text, id=cid, path=str(path))


_LEVEL_DIR_RE = re.compile(r"^level_?(\d+)$", re.IGNORECASE)
_SOLUTION_SUFFIXES = (".py", ".md", ".txt")


def _matches(component: str, task_name: str) -> bool:
    return component == task_name or (component.startswith(task_name) and component[len(task_name)] in "_.-")


def pair_solutions(tasks, solutions_dir: str | Path) -> tuple[list[tuple[object, Candidate]], list[str]]:
    """Pair every solution file under `solutions_dir` with its task by KernelBench file name.

    A file matches a task when a path component (file stem or directory) is the task's name (`19_ReLU`) or
    starts with it plus `_`, `.` or `-` (`19_ReLU_sample3.py`); a `levelN` directory in the path pins the
    level. Returns (pairs, unmatched file paths).
    """
    root = Path(solutions_dir)
    pairs, unmatched = [], []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in _SOLUTION_SUFFIXES):
        rel = path.relative_to(root)
        parts = [*rel.parent.parts, rel.stem]
        levels = {int(m.group(1)) for part in rel.parent.parts if (m := _LEVEL_DIR_RE.match(part))}
        hits = [t for t in tasks if (not levels or t.level in levels) and any(_matches(c, t.name) for c in parts)]
        hits = [t for t in hits if len(t.name) == max(len(h.name) for h in hits)]  # most specific name wins
        if len(hits) == 1:
            pairs.append((hits[0], load_candidate(path, id=str(rel))))
        else:
            unmatched.append(str(rel))
    return pairs, unmatched

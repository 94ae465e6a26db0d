"""The `Task` record and the loaders that build it from one file, a KernelBench-layout directory or JSONL.

A task is a Python program defining `class Model(nn.Module)`, `get_inputs()` and `get_init_inputs()`.
Loading only reads and statically checks the source; task code is never executed in the loading process.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

REQUIRED_NAMES = ("Model", "get_inputs", "get_init_inputs")
_FILE_RE = re.compile(r"^(?P<pid>\d+)_(?P<name>.+)\.py$")
_LEVEL_RE = re.compile(r"level_?(\d+)", re.IGNORECASE)


class TaskError(ValueError):
    """A task that cannot be used, with a message that names the file and the problem."""


@dataclass(frozen=True)
class Task:
    id: str  # stable id: "L1/19" for KernelBench files, otherwise the file stem or the JSONL id
    name: str  # human name: "19_ReLU"
    code: str
    level: int | None = None
    problem_id: int | None = None
    source: str = ""  # where it came from (path, or path:line for JSONL)
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.code.encode()).hexdigest()

    @property
    def file_name(self) -> str:
        """KernelBench's file name for the task, e.g. `19_ReLU.py`."""
        return f"{self.name}.py"


def missing_definitions(code: str) -> list[str]:
    """Names among `REQUIRED_NAMES` that the module does not define at top level (raises SyntaxError)."""
    tree = ast.parse(code)
    defined: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return [n for n in REQUIRED_NAMES if n not in defined]


def task_from_code(
    code: str,
    *,
    id: str,
    name: str | None = None,
    level: int | None = None,
    problem_id: int | None = None,
    source: str = "",
    meta: dict | None = None,
) -> Task:
    """Build a task from source text, checking that it parses and defines Model/get_inputs/get_init_inputs."""
    where = source or id
    try:
        missing = missing_definitions(code)
    except SyntaxError as e:
        raise TaskError(f"{where}: task has a syntax error at line {e.lineno}: {e.msg}") from None
    if missing:
        raise TaskError(f"{where}: task does not define {', '.join(missing)} (a KernelBench task needs "
                        "class Model, get_inputs() and get_init_inputs())")
    return Task(id=id, name=name or id, code=code, level=level, problem_id=problem_id, source=source,
                meta=dict(meta or {}))


def _ids_from_path(path: Path) -> tuple[str, str, int | None, int | None]:
    """(id, name, level, problem_id) from a KernelBench-style path such as `level1/19_ReLU.py`."""
    m = _FILE_RE.match(path.name)
    lm = _LEVEL_RE.search(path.parent.name)
    level = int(lm.group(1)) if lm else None
    if m:
        pid = int(m.group("pid"))
        tid = f"L{level}/{pid}" if level is not None else path.stem
        return tid, path.stem, level, pid
    return path.stem, path.stem, level, None


def load_task_file(path: str | Path) -> Task:
    path = Path(path)
    try:
        code = path.read_text()
    except FileNotFoundError:
        raise TaskError(f"{path}: task file not found") from None
    except UnicodeDecodeError as e:
        raise TaskError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); save the file "
                        "as UTF-8") from None
    except OSError as e:
        raise TaskError(f"{path}: cannot read task file: {e.strerror or e}") from None
    tid, name, level, pid = _ids_from_path(path)
    return task_from_code(code, id=tid, name=name, level=level, problem_id=pid, source=str(path))


def _load_jsonl(path: Path) -> list[Task]:
    tasks = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TaskError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); save the file "
                        "as UTF-8") from None
    except OSError as e:
        raise TaskError(f"{path}: cannot read task file: {e.strerror or e}") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(f"{where}: not valid JSON: {e.msg}") from None
        if "code" not in row:
            raise TaskError(f"{where}: JSONL task row has no 'code' field")
        level, pid = row.get("level"), row.get("problem_id")
        level = int(level) if level is not None else None
        pid = int(pid) if pid is not None else None
        file_name = Path(row.get("file", "")).name
        name = file_name[:-3] if file_name.endswith(".py") else row.get("name")
        if name and not file_name and pid is not None and not _FILE_RE.match(f"{name}.py"):
            name = f"{pid}_{name}"  # a bare op name: KernelBench files are "<id>_<name>.py"
        tid = row.get("id") or (f"L{level}/{pid}" if level is not None and pid is not None else name)
        if not tid:
            raise TaskError(f"{where}: JSONL task row needs 'id', or 'level' and 'problem_id'")
        tasks.append(task_from_code(row["code"], id=str(tid), name=name or str(tid), level=level,
                                    problem_id=pid, source=where))
    return tasks


def load_tasks(path: str | Path) -> list[Task]:
    """Load tasks from a `.py` file, a `.jsonl` file, or a directory (KernelBench layout or flat), sorted by id."""
    path = Path(path)
    if not path.exists():
        raise TaskError(f"{path}: no such task file or directory")
    if path.is_file():
        tasks = _load_jsonl(path) if path.suffix == ".jsonl" else [load_task_file(path)]
    else:
        files = sorted(p for p in path.rglob("*.py") if p.name != "__init__.py")
        if not files:
            raise TaskError(f"{path}: directory holds no task .py files")
        tasks = [load_task_file(p) for p in files]
    seen: dict[str, str] = {}
    for t in tasks:
        if t.id in seen:
            raise TaskError(f"duplicate task id {t.id!r}: {seen[t.id]} and {t.source}")
        seen[t.id] = t.source
    return sorted(tasks, key=_sort_key)


def _sort_key(t: Task) -> tuple:
    return (t.level if t.level is not None else 99, t.problem_id if t.problem_id is not None else 1 << 30, t.id)

"""Source adapters: every corpus format becomes a list of canonical `PairRecord`s, plus rejects with reasons.

One generic adapter (JSON / JSONL / Parquet rows + a `ColumnMapping`) covers most formats; presets name the
mappings of the shared corpora. The KernelBench leaderboard needs a join (solution → task version), so it has
its own adapter.
"""

from __future__ import annotations

import ast
import json
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from dice_kernels.data.records import Decision, PairRecord

INGEST = "ingest"
_FENCE_RE = re.compile(r"^[ \t]*```[ \t]*(?P<lang>[A-Za-z0-9_+-]*)[^\n]*$\n?", re.MULTILINE)
_PY_LANGS = {"python", "py", "python3", ""}
EXTRACT_MODES = ("none", "first", "last")


class SourceError(ValueError):
    """A source file or mapping that cannot be read: names the file and the problem."""


@dataclass(frozen=True)
class ColumnMapping:
    """Which columns of a row hold what. `id` may join several columns ("level", "problem") -> "1/19"."""

    reference: str
    kernel: str | None = None
    id: tuple[str, ...] = ()
    level: str | None = None
    extract_reference: str = "none"  # "first"/"last": take that fenced python block of the cell's text
    extract_kernel: str = "none"
    keep: tuple[str, ...] = ()  # extra columns copied into provenance

    @classmethod
    def parse(cls, spec: str) -> "ColumnMapping":
        """From `reference=col,kernel=col,id=a+b,level=col,extract_kernel=last,keep=x+y` (CLI form)."""
        fields: dict = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in cls.__dataclass_fields__:
                raise SourceError(f"bad column mapping entry {part!r}: expected one of "
                                  f"{', '.join(cls.__dataclass_fields__)} as key=value")
            fields[key] = tuple(value.split("+")) if key in ("id", "keep") else value
        if "reference" not in fields:
            raise SourceError(f"column mapping {spec!r} needs reference=<column>")
        mapping = cls(**fields)
        for mode in (mapping.extract_reference, mapping.extract_kernel):
            if mode not in EXTRACT_MODES:
                raise SourceError(f"extract mode must be one of {EXTRACT_MODES}, not {mode!r}")
        return mapping


PRESETS: dict[str, ColumnMapping] = {
    # dice_infill_eval_99.json: DICE's real PyTorch->CUDA pairs (prefix/middle/suffix are recomputed by infill).
    "dice_pairs": ColumnMapping(reference="pytorch_code", kernel="cuda_code", id=("id",)),
    # dice_rl_programs_4000.json: reference-only RL programs; cuda_code is empty in the file.
    "rl_programs": ColumnMapping(reference="pytorch_code", id=("idx",), level="level"),
    # kb_r1_sft_best1_with_reasoning.parquet: the reference sits in the question's code block, the kernel in
    # the answer's last block (earlier blocks are drafts inside the reasoning).
    "qa_parquet": ColumnMapping(reference="question", kernel="answer", id=("level", "problem"), level="level",
                                extract_reference="first", extract_kernel="last"),
}


@dataclass
class Loaded:
    records: list[PairRecord] = field(default_factory=list)
    rejected: list[Decision] = field(default_factory=list)

    def extend(self, other: "Loaded") -> None:
        self.records.extend(other.records)
        self.rejected.extend(other.rejected)


def read_rows(path: Path) -> list[dict]:
    """Rows of a .json (list of objects), .jsonl or .parquet file."""
    if not path.exists():
        raise SourceError(f"{path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    data = json.loads(path.read_text())
    if not isinstance(data, list):
        raise SourceError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    return data


def fenced_block(text: str, which: str) -> str | None:
    """The first or last fenced ```python (or unlabelled) block, dedented; None when there is none.

    Fences are paired from the start for "first" and from the end for "last": model answers sometimes close a
    block they never opened, which would shift every later pairing by one if all were paired from the start.
    """
    fences = list(_FENCE_RE.finditer(text))
    if which == "first":
        pairs = zip(fences[0::2], fences[1::2])
    else:
        rev = fences[::-1]
        pairs = ((b, a) for a, b in zip(rev[0::2], rev[1::2]))
    for opening, closing in pairs:
        if opening.group("lang").lower() in _PY_LANGS:
            body = text[opening.end() : closing.start()]
            # Prompt templates often indent only the block's first line; dedent what is uniform, trim the rest.
            return textwrap.dedent(body).strip() + "\n" if body.strip() else None
    return None


def _cell(row: dict, column: str, mode: str) -> str | None:
    value = row.get(column)
    if not isinstance(value, str) or not value.strip():
        return None
    return value if mode == "none" else fenced_block(value, mode)


def parse_level(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def load_mapped(path: str | Path, mapping: ColumnMapping, source: str) -> Loaded:
    """Generic adapter: one record per row that has a reference (and a kernel, when the mapping names one)."""
    path = Path(path)
    out = Loaded()
    for i, row in enumerate(read_rows(path)):
        native = "/".join(str(row.get(c)) for c in mapping.id) if mapping.id else str(i)
        rid = f"{source}/{native}"
        reference = _cell(row, mapping.reference, mapping.extract_reference)
        kernel = _cell(row, mapping.kernel, mapping.extract_kernel) if mapping.kernel else ""
        if reference is None:
            out.rejected.append(Decision(INGEST, rid, "drop", f"no reference program in column "
                                         f"{mapping.reference!r} (extract={mapping.extract_reference})",
                                         {"file": str(path), "row": i}))
            continue
        if kernel is None:
            out.rejected.append(Decision(INGEST, rid, "drop", f"no kernel program in column {mapping.kernel!r} "
                                         f"(extract={mapping.extract_kernel})", {"file": str(path), "row": i}))
            continue
        level = parse_level(row.get(mapping.level)) if mapping.level else None
        provenance = {"file": path.name, "row": i, "native_id": native,
                      **{k: row.get(k) for k in mapping.keep}}
        if level is None:
            level = estimated_level(reference)
            provenance["level_estimated"] = level is not None
        out.records.append(PairRecord(id=rid, source=source, reference=reference, kernel=kernel or "",
                                      level=level, provenance=provenance))
    return out


def load_preset(path: str | Path, preset: str, source: str | None = None) -> Loaded:
    if preset not in PRESETS:
        raise SourceError(f"unknown preset {preset!r}: one of {', '.join(PRESETS)}")
    return load_mapped(path, PRESETS[preset], source or preset)


_LEADERBOARD_PUBLISHED = ("torch_speedup", "torch_compile_speedup", "baseline_torch_time",
                          "baseline_torch_compile_time", "kernel_eval_time")


def load_leaderboard(solutions: str | Path, tasks: str | Path, source: str = "kb_leaderboard") -> Loaded:
    """KernelBench leaderboard solutions joined on (level, problem_id) with the task versions they were written for.

    Solutions must be paired with `kb_leaderboard_tasks_v0.jsonl`: today's tasks changed shapes, so most of the
    solutions would fail against them for reasons that have nothing to do with the kernels. The leaderboard's
    `problem_id` counts from 0 (problem_id 18 holds ReLU kernels, task 19), the task files' from 1.
    """
    solutions, tasks = Path(solutions), Path(tasks)
    task_code = {(int(t["level"]), int(t["problem_id"])): t["code"] for t in read_rows(tasks)}
    out = Loaded()
    for i, row in enumerate(read_rows(solutions)):
        level, pid = int(row["level"]), int(row["problem_id"]) + 1
        rid = f"{source}/L{level}/{pid}/{row.get('file', i)}"
        if (level, pid) not in task_code:
            out.rejected.append(Decision(INGEST, rid, "drop", f"no task L{level}/{pid} in {tasks.name}: the "
                                         "solution cannot be paired with its reference", {"row": i}))
            continue
        out.records.append(PairRecord(
            id=rid, source=source, reference=task_code[(level, pid)], kernel=row["code"], level=level,
            provenance={"file": solutions.name, "row": i, "task_file": tasks.name, "problem_id": pid,
                        "model": row.get("model"), "published_hardware": "L40S",
                        "published": {k: row.get(k) for k in _LEADERBOARD_PUBLISHED}}))
    return out


def estimated_level(reference: str) -> int | None:
    """Difficulty proxy for sources without a level: 1 = one operation in `Model.forward`, 2 = several (a fusion).

    Counts calls and arithmetic operators in forward; a program that does not parse gets None.
    """
    try:
        tree = ast.parse(reference)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Model":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "forward":
                    ops = sum(isinstance(n, (ast.Call, ast.BinOp)) for n in ast.walk(fn))
                    return 1 if ops <= 1 else 2
    return None

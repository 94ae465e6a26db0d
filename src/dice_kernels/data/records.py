"""The canonical curation record (`PairRecord`), its verification result, and the per-pair decision log.

Every stage reads and writes these as JSONL, so a stage's output can be inspected, diffed and resumed from.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

# Verification statuses: verified (correct, not deceptive, timed), failed (harness said no), unverified (not
# run: no GPU for a CUDA kernel, or nothing to run), and pending (not yet through the verify stage).
VERIFIED, FAILED, UNVERIFIED, PENDING = "verified", "failed", "unverified", "pending"


@dataclass
class Verification:
    status: str = PENDING
    reason: str = ""  # why not verified (or a one-line summary when verified)
    outcome: str = ""  # harness Outcome value, empty when the harness was not called
    correct: bool = False
    deceptive_kind: str = ""
    speedup: float | None = None
    ref_time_ms: float | None = None
    cand_time_ms: float | None = None
    backend: str = ""
    hardware: str = ""


@dataclass
class PairRecord:
    """One PyTorch reference program and (optionally) one ModelNew kernel program written for it."""

    id: str  # "<source>/<native id>", unique within a build
    source: str  # adapter name: dice_pairs, kb_leaderboard, qa_parquet, or the generic adapter's label
    reference: str  # KernelBench-format PyTorch program (class Model, get_inputs, get_init_inputs)
    kernel: str = ""  # ModelNew program; empty for reference-only records (RL task programs)
    level: int | None = None  # difficulty: KernelBench level, or the source's own level
    provenance: dict = field(default_factory=dict)  # file, row, native ids, published speedups, model, ...
    verification: Verification = field(default_factory=Verification)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict) -> "PairRecord":
        row = dict(row)
        row["verification"] = Verification(**row.get("verification") or {})
        return cls(**row)


@dataclass
class Decision:
    """One judgement about one pair at one stage: kept, dropped or marked, and why."""

    stage: str
    pair_id: str
    action: str  # "keep" | "drop" | "mark"
    reason: str
    details: dict = field(default_factory=dict)


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    """Write atomically (temp file + rename) so an interrupted stage never leaves a half file that looks done."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def write_records(path: Path, records: Iterable[PairRecord]) -> None:
    write_jsonl(path, (r.to_dict() for r in records))


def read_records(path: Path) -> list[PairRecord]:
    return [PairRecord.from_dict(row) for row in read_jsonl(path)]


def write_decisions(path: Path, decisions: Iterable[Decision]) -> None:
    write_jsonl(path, (asdict(d) for d in decisions))


def read_decisions(path: Path) -> list[Decision]:
    return [Decision(**row) for row in read_jsonl(path)]

"""Training formats: SFT (prompt, response) rows in the Qwen3 chat format, and the two RL task sets.

SFT rows are written as JSONL and Parquet (both load with `datasets.load_dataset`). RL task sets are ordered
easy -> hard (stable sort by level) and consumed by `schedule` 64 tasks per step, wrapping around.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from functools import lru_cache
from itertools import cycle, islice
from pathlib import Path
from typing import Iterator

from dice_kernels.data.infill import InfillSplit, split_program
from dice_kernels.prompts import (EXAMPLE_MODEL_NEW, EXAMPLE_MODEL_NEW_CPU, SYSTEM_PROMPT, chat_prompt, chat_response,
                                  code_block, e2e_user, infill_user)
from dice_kernels.data.records import PairRecord, write_jsonl

E2E, INFILL = "e2e", "infill"


@dataclass(frozen=True)
class SFTRow:
    id: str  # "<pair id>#<kind>"
    pair_id: str
    source: str
    kind: str  # e2e | infill
    level: int | None
    speedup: float | None
    prompt: str  # chat text up to and including the assistant header and empty think block
    response: str  # assistant text, ending with <|im_end|>


@lru_cache(maxsize=2)
def example_cut(backend: str = "cuda") -> tuple[str, str, str]:
    """The infilling cut of the prompts' worked example (the C++ one for backend "cpu")."""
    s = split_program(EXAMPLE_MODEL_NEW_CPU if backend == "cpu" else EXAMPLE_MODEL_NEW)
    return s.prefix, s.core, s.suffix


def e2e_prompt(reference: str, system: str | None = SYSTEM_PROMPT, backend: str = "cuda") -> str:
    return chat_prompt(e2e_user(reference, backend), system)


def infill_prompt(reference: str, split: InfillSplit, system: str | None = SYSTEM_PROMPT, backend: str = "cuda") -> str:
    return chat_prompt(infill_user(reference, split.prefix, split.suffix, example_cut(backend), backend), system)


def sft_rows(records: list[PairRecord], splits: dict[str, InfillSplit], kinds: tuple[str, ...] = (E2E, INFILL),
             system: str | None = SYSTEM_PROMPT, backend: str = "cuda") -> list[SFTRow]:
    """One e2e row per pair and one infill row per pair that has a split; both answer with the whole program.
    backend "cpu" words the prompts for C++ kernels (prompts.e2e_user), as the RL rollouts and `dice bench` do."""
    rows = []
    for r in records:
        response = chat_response(code_block(r.kernel))
        common = dict(pair_id=r.id, source=r.source, level=r.level, speedup=r.verification.speedup,
                      response=response)
        if E2E in kinds:
            rows.append(SFTRow(id=f"{r.id}#{E2E}", kind=E2E, prompt=e2e_prompt(r.reference, system, backend), **common))
        if INFILL in kinds and r.id in splits:
            rows.append(SFTRow(id=f"{r.id}#{INFILL}", kind=INFILL,
                               prompt=infill_prompt(r.reference, splits[r.id], system, backend),
                               **common))
    return rows


def write_table(rows: list[dict], out_dir: Path, stem: str) -> tuple[Path, Path]:
    """`<stem>.jsonl` and `<stem>.parquet` with the same rows (empty sets still get a valid schema-less file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl, parquet = out_dir / f"{stem}.jsonl", out_dir / f"{stem}.parquet"
    write_jsonl(jsonl, rows)
    tmp = parquet.with_suffix(".parquet.tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.replace(parquet)
    return jsonl, parquet


def write_sft(rows: list[SFTRow], out_dir: Path, stem: str = "sft") -> tuple[Path, Path]:
    return write_table([asdict(r) for r in rows], out_dir, stem)


def by_difficulty(rows: list[dict]) -> list[dict]:
    """Stable sort by level (unknown levels last): single operators, then fusions, then whole models."""
    return sorted(rows, key=lambda row: row["level"] if row["level"] is not None else 1 << 30)


def rl_e2e_tasks(records: list[PairRecord], system: str | None = SYSTEM_PROMPT, backend: str = "cuda") -> list[dict]:
    return by_difficulty([{"id": r.id, "source": r.source, "level": r.level, "reference": r.reference,
                           "prompt": e2e_prompt(r.reference, system, backend)} for r in records])


def holdout_infill(records: list[PairRecord], splits: dict[str, InfillSplit],
                   fraction: float) -> tuple[list[PairRecord], dict[str, InfillSplit]]:
    """(the SFT pairs, the infilling RL splits) with `fraction` of the pairs that have a split held out of SFT for
    RL infilling (DICE's infilling programs are a set apart from its SFT pairs): the choice hashes each pair id, so
    it is stable across reruns and record order. 0: every pair in SFT, infilling tasks cut from the same pairs."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"infill holdout fraction must be in [0, 1], got {fraction}")
    if fraction == 0:
        return records, splits
    held = {k for k in splits if int(hashlib.sha256(k.encode()).hexdigest()[:8], 16) < fraction * 16**8}
    return [r for r in records if r.id not in held], {k: v for k, v in splits.items() if k in held}


def rl_infill_tasks(records: list[PairRecord], splits: dict[str, InfillSplit],
                    system: str | None = SYSTEM_PROMPT, backend: str = "cuda") -> list[dict]:
    """Infilling tasks: the reward runs prefix + generated core + suffix; `core` is the known-good answer."""
    return by_difficulty([{"id": r.id, "source": r.source, "level": r.level, "reference": r.reference,
                           "prefix": splits[r.id].prefix, "core": splits[r.id].core, "suffix": splits[r.id].suffix,
                           "prompt": infill_prompt(r.reference, splits[r.id], system, backend)}
                          for r in records if r.id in splits])


def schedule(tasks: list[dict], batch_size: int = 64) -> Iterator[list[dict]]:
    """Endless step batches: tasks in order, `batch_size` per step, wrapping around at the end of the list."""
    if not tasks:
        raise ValueError("cannot schedule an empty task set")
    stream = cycle(tasks)
    while True:
        yield list(islice(stream, batch_size))

"""Deduplication within a set of pairs: exact (hash of normalised tokens) and near (MinHash LSH, datasketch).

A pair is represented by its reference and kernel tokens together, so the same kernel pasted under two
different references stays (two prompts), while re-formatted or lightly edited copies go. Within a cluster
the fastest verified pair is kept, ties broken by id, so the survivor does not depend on input order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from dice_kernels.data.normalise import code_tokens, ngrams
from dice_kernels.data.records import Decision, PairRecord

STAGE = "dedupe"


@dataclass(frozen=True)
class DedupeConfig:
    threshold: float = 0.85  # estimated Jaccard of shingle sets at or above which two pairs are near-duplicates
    shingle: int = 5  # tokens per shingle
    num_perm: int = 128  # MinHash permutations (estimate's std ≈ sqrt(J(1-J)/num_perm) ≈ 0.03 at J = 0.85)
    seed: int = 1
    # Off for reference-only RL programs: they are short, so one changed operator (sigmoid vs tanh) keeps most
    # shingles, yet it is a different task.
    near: bool = True


def pair_tokens(record: PairRecord) -> list[str]:
    # The separator keeps a reference token run from fusing with the kernel's first tokens into one shingle.
    return code_tokens(record.reference) + ["<kernel>"] + code_tokens(record.kernel)


def exact_key(tokens: list[str]) -> str:
    return hashlib.sha256("\x00".join(tokens).encode()).hexdigest()


def _priority(record: PairRecord) -> tuple:
    speedup = record.verification.speedup
    return (-(speedup if speedup is not None else float("-inf")), record.id)


def dedupe(records: list[PairRecord], config: DedupeConfig = DedupeConfig()) -> tuple[list[PairRecord], list[Decision]]:
    """(kept records in input order, one decision per record)."""
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(threshold=config.threshold, num_perm=config.num_perm)
    exact: dict[str, str] = {}
    sketches: dict[str, MinHash] = {}
    kept_ids: set[str] = set()
    decisions: dict[str, Decision] = {}
    for record in sorted(records, key=_priority):
        tokens = pair_tokens(record)
        key = exact_key(tokens)
        if key in exact:
            decisions[record.id] = Decision(STAGE, record.id, "drop", f"exact duplicate of {exact[key]} "
                                            "after normalisation (comments, whitespace, numbers)",
                                            {"duplicate_of": exact[key]})
            continue
        if not config.near:
            exact[key] = record.id
            kept_ids.add(record.id)
            decisions[record.id] = Decision(STAGE, record.id, "keep", "no exact duplicate in the set")
            continue
        sketch = MinHash(num_perm=config.num_perm, seed=config.seed)
        sketch.update_batch([g.encode() for g in ngrams(tokens, config.shingle)])
        # LSH returns candidates; confirm each with the MinHash estimate so banding false positives do not drop.
        scored = [(sketch.jaccard(sketches[c]), c) for c in lsh.query(sketch)]
        close = max(scored, default=(0.0, ""))
        if close[0] >= config.threshold:
            decisions[record.id] = Decision(STAGE, record.id, "drop", f"near-duplicate of {close[1]} (estimated "
                                            f"Jaccard {close[0]:.2f} >= {config.threshold})",
                                            {"duplicate_of": close[1], "jaccard": round(close[0], 4)})
            continue
        exact[key] = record.id
        sketches[record.id] = sketch
        lsh.insert(record.id, sketch)
        kept_ids.add(record.id)
        decisions[record.id] = Decision(STAGE, record.id, "keep", "no duplicate in the set")
    kept = [r for r in records if r.id in kept_ids]
    return kept, [decisions[r.id] for r in records]

"""Decontamination: drop pairs whose reference program overlaps a benchmark (KernelBench) task.

Score = max over benchmark tasks of the containment |G(ref) ∩ G(task)| / |G(ref)|, where G is the set of
normalised token 8-grams minus "boilerplate" 8-grams (those found in more than 5% of the benchmark tasks:
imports, `get_inputs`/`get_init_inputs` scaffolding, `super().__init__()`), so format alone never matches.
A pair is dropped at score >= 0.5; docs/data.md gives the measurements behind n = 8 and 0.5.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from dice_kernels.data.normalise import code_tokens, ngrams
from dice_kernels.data.records import Decision, PairRecord

STAGE = "decontam"


@dataclass(frozen=True)
class DecontamConfig:
    n: int = 8  # token n-gram length
    threshold: float = 0.5  # containment at or above which a reference counts as a benchmark task
    boilerplate_df: float = 0.05  # n-grams in more than this fraction of benchmark tasks are ignored


@dataclass
class BenchmarkIndex:
    """N-gram sets of the benchmark tasks with an inverted index, built once per run."""

    task_ids: list[str]
    grams: list[set[str]]
    boilerplate: set[str]
    postings: dict[str, list[int]] = field(repr=False)
    config: DecontamConfig


@dataclass(frozen=True)
class Overlap:
    score: float  # containment of the query's n-grams in the best-matching task
    task_id: str  # best-matching task ("" when nothing is shared)
    shared: int  # n-grams shared with that task
    total: int  # the query's n-grams after boilerplate removal


def default_benchmark_paths() -> list[Path]:
    """KernelBench as it is today and the v0 task versions, from `../shared/data` next to the checkout.

    Both versions count as the benchmark: a v0 task whose problem changed since (L1/97, L2/41) is still
    KernelBench material, and only indexing it catches its descendants.
    """
    data = Path(__file__).resolve().parents[3].parent / "shared" / "data"
    paths = [data / "kernelbench" / "tasks.jsonl", data / "corpora" / "kb_leaderboard_tasks_v0.jsonl"]
    return [p for p in paths if p.exists()]


def build_index(tasks: list[tuple[str, str]], config: DecontamConfig = DecontamConfig()) -> BenchmarkIndex:
    """Index `(task_id, code)` pairs; n-grams frequent across tasks are boilerplate and excluded."""
    raw = [ngrams(code_tokens(code), config.n) for _, code in tasks]
    df = Counter(g for grams in raw for g in grams)
    # At least two tasks must share an n-gram for it to be boilerplate (matters only for tiny benchmarks).
    boilerplate = {g for g, c in df.items() if c > max(1.0, config.boilerplate_df * len(tasks))}
    grams = [g - boilerplate for g in raw]
    postings: dict[str, list[int]] = defaultdict(list)
    for i, gs in enumerate(grams):
        for g in gs:
            postings[g].append(i)
    return BenchmarkIndex([tid for tid, _ in tasks], grams, boilerplate, dict(postings), config)


def load_benchmark(paths: list[Path], config: DecontamConfig = DecontamConfig()) -> BenchmarkIndex:
    """Index the tasks of one or more task files/directories (anything `dice_kernels.tasks.load_tasks` reads)."""
    from dice_kernels.tasks import load_tasks

    tasks = [(f"{p.name}:{t.id}", t.code) for p in paths for t in load_tasks(p)]
    return build_index(tasks, config)


def overlap(index: BenchmarkIndex, code: str) -> Overlap:
    query = ngrams(code_tokens(code), index.config.n) - index.boilerplate
    hits = Counter(i for g in query for i in index.postings.get(g, ()))
    if not query or not hits:
        return Overlap(0.0, "", 0, len(query))
    best, shared = max(hits.items(), key=lambda kv: (kv[1], -kv[0]))
    return Overlap(shared / len(query), index.task_ids[best], shared, len(query))


def decontaminate(records: list[PairRecord], index: BenchmarkIndex) -> tuple[list[PairRecord], list[Decision]]:
    """(records whose reference stays below the threshold, one decision per record with its score)."""
    kept, decisions = [], []
    threshold = index.config.threshold
    for r in records:
        o = overlap(index, r.reference)
        details = {"score": round(o.score, 4), "task": o.task_id, "shared": o.shared, "total": o.total}
        if o.score >= threshold:
            decisions.append(Decision(STAGE, r.id, "drop", f"reference overlaps benchmark task {o.task_id}: "
                                      f"{o.shared}/{o.total} of its {index.config.n}-grams "
                                      f"({o.score:.2f} >= {threshold})", details))
        else:
            kept.append(r)
            decisions.append(Decision(STAGE, r.id, "keep", f"max overlap {o.score:.2f} < {threshold}", details))
    return kept, decisions

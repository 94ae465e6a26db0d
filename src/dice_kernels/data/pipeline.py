"""`build`: the CuKe curation pipeline, stage by stage, resumable, with every decision logged.

ingest -> verify -> filter -> dedupe -> decontam -> split -> format (+ RL task sets) -> report. Each judging stage
writes `<stage>.jsonl` (records that pass), `<stage>.decisions.jsonl` and `<stage>.done.json` (a fingerprint of
its input file and its settings); a rerun loads a stage whose fingerprint matches instead of recomputing it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from dice_kernels.data import decontam as dc
from dice_kernels.data.dedupe import DedupeConfig, dedupe
from dice_kernels.data.filters import FilterConfig, speed_filter
from dice_kernels.data.format import (E2E, INFILL, holdout_infill, rl_e2e_tasks, rl_infill_tasks, sft_rows, write_sft,
                                      write_table)
from dice_kernels.data.infill import InfillError, InfillSplit, split_program
from dice_kernels.prompts import SYSTEM_PROMPT
from dice_kernels.data.records import (FAILED, UNVERIFIED, VERIFIED, Decision, PairRecord, read_decisions,
                                       read_records, write_decisions, write_jsonl, write_records)
from dice_kernels.data.sources import INGEST, ColumnMapping, Loaded, load_leaderboard, load_mapped, load_preset

STAGES = ["ingest", "verify", "filter", "dedupe", "decontam", "split"]


@dataclass(frozen=True)
class SourceSpec:
    """One input: `kind` is a preset name (dice_pairs, qa_parquet, ...), "leaderboard" (paths: solutions, tasks)
    or "mapped" (paths: one file; `mapping` in ColumnMapping.parse form)."""

    kind: str
    paths: tuple[str, ...]
    name: str = ""
    mapping: str = ""

    def load(self) -> Loaded:
        if self.kind == "leaderboard":
            return load_leaderboard(self.paths[0], self.paths[1], self.name or "kb_leaderboard")
        if self.kind == "mapped":
            return load_mapped(self.paths[0], ColumnMapping.parse(self.mapping), self.name or Path(self.paths[0]).stem)
        return load_preset(self.paths[0], self.kind, self.name or None)


@dataclass
class CurationConfig:
    out_dir: Path
    sources: list[SourceSpec]
    benchmark: list[Path]  # task files/dirs to decontaminate against (KernelBench tasks.jsonl)
    eval: object  # dice_kernels.harness.config.EvalConfig
    rl_programs: Path | None = None  # reference-only programs for the end-to-end RL phase
    filter: FilterConfig = field(default_factory=FilterConfig)
    dedupe: DedupeConfig = field(default_factory=DedupeConfig)
    decontam: dc.DecontamConfig = field(default_factory=dc.DecontamConfig)
    sft_kinds: tuple[str, ...] = (E2E, INFILL)  # (E2E,): an SFT set without infilling rows, as CuKe's
    # fraction of the pairs with an infill split held out of SFT as the RL infilling set (DICE's is a set apart);
    # 0: every pair in SFT and the infilling tasks cut from the same pairs
    infill_holdout: float = 0.0
    system_prompt: str | None = SYSTEM_PROMPT
    progress: bool = True
    limit: int | None = None  # first N pairs per source (device time is scarce: ~1 compile per pair)
    # harness databases of earlier runs (another machine, a shard of this build) whose results verify reuses
    import_results: tuple[Path, ...] = ()


def _sha_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class StageResult:
    records: list[PairRecord]
    decisions: list[Decision]
    reused: bool


def run_stage(out_dir: Path, name: str, fingerprint: str,
              compute: Callable[[], tuple[list[PairRecord], list[Decision]]]) -> StageResult:
    """Reuse `<name>.jsonl` when its done-marker carries `fingerprint`; otherwise compute and write it."""
    rec_path, dec_path, done = (out_dir / f"{name}.jsonl", out_dir / f"{name}.decisions.jsonl",
                                out_dir / f"{name}.done.json")
    if done.exists() and rec_path.exists() and dec_path.exists():
        if json.loads(done.read_text()).get("fingerprint") == fingerprint:
            return StageResult(read_records(rec_path), read_decisions(dec_path), True)
    done.unlink(missing_ok=True)  # the marker goes first: a crash mid-write must not leave a stale "done"
    records, decisions = compute()
    write_records(rec_path, records)
    write_decisions(dec_path, decisions)
    done.write_text(json.dumps({"fingerprint": fingerprint}))
    return StageResult(records, decisions, False)


def ingest(sources: list[SourceSpec], limit: int | None = None) -> tuple[list[PairRecord], list[Decision]]:
    loaded = Loaded()
    for spec in sources:
        loaded.extend(spec.load())
    kept, decisions, seen = [], list(loaded.rejected), set()
    per_source: dict[str, int] = {}
    for r in loaded.records:
        per_source[r.source] = per_source.get(r.source, 0) + 1
        if limit is not None and per_source[r.source] > limit:
            decisions.append(Decision(INGEST, r.id, "drop", f"beyond the first {limit} pairs of {r.source} (--limit)"))
            continue
        if r.id in seen:
            decisions.append(Decision(INGEST, r.id, "drop", "duplicate id: an earlier record has the same id"))
            continue
        seen.add(r.id)
        kept.append(r)
        decisions.append(Decision(INGEST, r.id, "keep", f"read from {r.provenance.get('file', r.source)}"))
    return kept, decisions


def verify_stage(records: list[PairRecord], cfg: CurationConfig) -> tuple[list[PairRecord], list[Decision]]:
    from dice_kernels.data.verify import verify

    results = verify(records, cfg.eval, out_dir=cfg.out_dir / "harness", resume=True, progress=cfg.progress)
    kept, decisions = [], []
    action = {VERIFIED: "keep", UNVERIFIED: "mark", FAILED: "drop"}
    for r, v in zip(records, results):
        r.verification = v
        decisions.append(Decision("verify", r.id, action[v.status], f"{v.status}: {v.reason}",
                                  {"outcome": v.outcome, "speedup": v.speedup, "backend": v.backend}))
        if v.status != FAILED:
            kept.append(r)
    return kept, decisions


def split_stage(records: list[PairRecord]) -> tuple[list[PairRecord], list[Decision], dict[str, InfillSplit]]:
    """Every record passes; those whose kernel has a cuttable CUDA source also get an infill split."""
    splits, decisions = {}, []
    for r in records:
        try:
            s = split_program(r.kernel)
        except InfillError as e:
            decisions.append(Decision("split", r.id, "mark", f"no infill split: {e}"))
            continue
        splits[r.id] = s
        decisions.append(Decision("split", r.id, "keep", f"infill split on variable {s.variable!r}",
                                  {"prefix_chars": len(s.prefix), "core_chars": len(s.core), "suffix_chars": len(s.suffix)}))
    return records, decisions, splits


def _eval_settings(eval_cfg) -> dict:
    # what changes with the machine, not the result, stays out of the fingerprint
    machine = ("build.jobs", "cache_dir", "scheduler.run_workers", "sandbox.memory_limit_gb")
    return {k: v for k, v in eval_cfg.settings().items() if k not in machine}


def _import_results(db: Path, sources: tuple[Path, ...], log: Callable[[str], None]) -> int:
    """Copy results of other harness databases into this build's; returns how many came in."""
    if not sources:
        return 0
    from dice_kernels.harness.store import ResultStore

    missing = [str(p) for p in sources if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"results database not found: {', '.join(missing)}")
    store = ResultStore(db)
    try:
        counts = {str(p): store.import_from(p) for p in sources}
    finally:
        store.close()
    for path, n in counts.items():
        log(f"imported {n} results from {path}")
    return sum(counts.values())


def build(cfg: CurationConfig, log: Callable[[str], None] = print) -> dict:
    """Run (or resume) every stage; returns the report dict (also written to out_dir/report.json)."""
    out = cfg.out_dir
    out.mkdir(parents=True, exist_ok=True)
    input_files = sorted({p for s in cfg.sources for p in s.paths})
    fp = _fingerprint([asdict(s) for s in cfg.sources], {p: _sha_file(Path(p)) for p in input_files})
    stages: dict[str, StageResult] = {}

    def step(name: str, settings, compute) -> list[PairRecord]:
        prev = STAGES[STAGES.index(name) - 1] if name != "ingest" else None
        key = _fingerprint(settings, _sha_file(out / f"{prev}.jsonl") if prev else fp)
        res = run_stage(out, name, key, compute)
        stages[name] = res
        n_drop = sum(d.action == "drop" for d in res.decisions)
        log(f"{name:9s} {'reused' if res.reused else 'done':6s} kept {len(res.records)}, dropped {n_drop}")
        return res.records

    records = step("ingest", cfg.limit, lambda: ingest(cfg.sources, cfg.limit))
    imported = _import_results(out / "harness" / "results.sqlite", cfg.import_results, log)
    # results that came in make verify run again, reusing every recorded one
    records = step("verify", {**_eval_settings(cfg.eval), **({"imported": imported} if imported else {})},
                   lambda: verify_stage(records, cfg))
    verified = records
    records = step("filter", asdict(cfg.filter), lambda: speed_filter(records, cfg.filter))
    records = step("dedupe", asdict(cfg.dedupe), lambda: dedupe(records, cfg.dedupe))
    index = _benchmark_index(cfg)
    records = step("decontam", [asdict(cfg.decontam), [str(p) for p in cfg.benchmark]],
                   lambda: dc.decontaminate(records, index))
    final, split_decisions, splits = split_stage(records)
    write_decisions(out / "split.decisions.jsonl", split_decisions)
    write_jsonl(out / "infill_splits.jsonl", ({"pair_id": k, **asdict(v)} for k, v in splits.items()))
    write_records(out / "split.jsonl", final)
    stages["split"] = StageResult(final, split_decisions, False)

    sft_pairs, rl_splits = holdout_infill(final, splits, cfg.infill_holdout)
    sft = sft_rows(sft_pairs, splits, cfg.sft_kinds, cfg.system_prompt)
    write_sft(sft, out, "sft")
    infill_tasks = rl_infill_tasks(final, rl_splits, cfg.system_prompt)
    write_table(infill_tasks, out, "rl_infill")
    extra = {"sft_rows": {k: sum(r.kind == k for r in sft) for k in cfg.sft_kinds},
             "rl_infill_tasks": len(infill_tasks)}
    rl_decisions: list[Decision] = []
    if cfg.rl_programs:
        e2e_tasks, rl_decisions, rl_counts = rl_e2e_set(cfg.rl_programs, index, cfg.system_prompt, cfg.limit)
        write_table(e2e_tasks, out, "rl_e2e")
        extra["rl_e2e"] = rl_counts
    all_decisions = [d for name in STAGES for d in stages[name].decisions] + rl_decisions
    write_decisions(out / "decisions.jsonl", all_decisions)
    from dice_kernels.data.report import write_report

    ingested = stages["ingest"].records
    return write_report(out, ingested, verified, final, all_decisions, STAGES, cfg.filter.min_speedup, extra)


def _benchmark_index(cfg: CurationConfig) -> dc.BenchmarkIndex:
    if not cfg.benchmark:
        raise ValueError("decontamination needs benchmark tasks: pass --benchmark PATH (KernelBench tasks.jsonl)")
    return dc.load_benchmark(cfg.benchmark, cfg.decontam)


def rl_e2e_set(path: Path, index: dc.BenchmarkIndex, system: str | None,
               limit: int | None = None) -> tuple[list[dict], list[Decision], dict]:
    """End-to-end RL tasks: reference programs (the first `limit`, like every source under --limit), exact
    duplicates removed, decontaminated, ordered easy -> hard."""
    loaded = load_preset(path, "rl_programs")
    deduped, d1 = dedupe(loaded.records[:limit], DedupeConfig(near=False))
    clean, d2 = dc.decontaminate(deduped, index)
    decisions = [Decision("rl_e2e", d.pair_id, d.action, f"{d.stage}: {d.reason}", d.details)
                 for d in loaded.rejected + d1 + d2]
    counts = {"read": len(loaded.records) + len(loaded.rejected), **({"limit": limit} if limit is not None else {}),
              "after_dedupe": len(deduped),
              "after_decontam": len(clean)}
    return rl_e2e_tasks(clean, system), decisions, counts


"""`dice data ...`: build the CuKe set, cut infilling splits, build RL task sets, measure benchmark overlap.

Thin: each command parses its options and calls the stage modules; heavy imports stay inside the commands.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from dice_kernels.cli_errors import fail, need_extra
from dice_kernels.harness.cli_options import eval_options

app = typer.Typer(help="CuKe data curation: sources -> verify -> filter -> dedupe -> decontaminate -> format.",
                  no_args_is_help=True)


def _benchmarks(paths: Optional[list[Path]]) -> list[Path]:
    from dice_kernels.data.decontam import default_benchmark_paths

    if paths:
        return paths
    defaults = default_benchmark_paths()
    if not defaults:
        fail("no --benchmark given and ../shared/data/kernelbench/tasks.jsonl is absent: pass --benchmark "
              "KernelBench's tasks.jsonl")
    return defaults


@app.command()
@eval_options
def build(
    out: Path = typer.Option(..., "--out", help="Output directory (reruns resume from it)."),
    dice_pairs: Optional[list[Path]] = typer.Option(None, help="DICE pairs JSON (dice_infill_eval_99.json)."),
    leaderboard: Optional[Path] = typer.Option(None, help="Leaderboard solutions JSON."),
    leaderboard_tasks: Optional[Path] = typer.Option(None, help="Task versions the leaderboard solved (v0 JSONL)."),
    qa_parquet: Optional[list[Path]] = typer.Option(None, help="Parquet with question/answer columns."),
    generic: Optional[list[str]] = typer.Option(
        None, help="PATH@MAPPING, e.g. 'rows.jsonl@reference=ref,kernel=sol,id=key,level=lvl'."),
    rl_programs: Optional[Path] = typer.Option(None, help="RL reference programs (dice_rl_programs_4000.json)."),
    benchmark: Optional[list[Path]] = typer.Option(None, help="Benchmark tasks to decontaminate against "
                                                    "[default: ../shared/data KernelBench tasks.jsonl + kb_leaderboard_tasks_v0.jsonl]."),
    min_speedup: float = typer.Option(2.0, help="Keep pairs at least this much faster than PyTorch eager."),
    min_ref_ms: float = typer.Option(0.0, help="Drop pairs whose reference runs faster than this (ms)."),
    keep_unverified: bool = typer.Option(False, help="Let unverified pairs through the filter (CPU dry runs)."),
    near_dup: float = typer.Option(0.85, help="MinHash Jaccard at which two pairs are near-duplicates."),
    overlap: float = typer.Option(0.5, help="Benchmark n-gram containment at which a reference is contaminated."),
    infill_holdout: float = typer.Option(
        0.0, min=0.0, max=1.0, help="Share of the pairs with an infill split held out of SFT as the only RL "
                                    "infilling tasks (DICE's infilling programs are a set apart; 0: infilling "
                                    "tasks cut from the SFT pairs)."),
    sft_infill_rows: bool = typer.Option(True, "--sft-infill-rows/--no-sft-infill-rows",
                                         help="Also write an infilling SFT row per splittable pair (off: "
                                              "end-to-end rows only, as CuKe)."),
    limit: Optional[int] = typer.Option(None, min=1, help="Only the first N pairs of each source (and of "
                                                          "--rl-programs)."),
    import_results: Optional[list[Path]] = typer.Option(
        None, exists=True, dir_okay=False, help="A harness results.sqlite of another run (a shard verified on "
                                                "another GPU or machine) whose results verify reuses (repeatable)."),
    progress: Optional[bool] = typer.Option(None, "--progress/--no-progress", show_default="a bar on a terminal",
                                            help="Progress bars, or a line per evaluated pair (for logs). Default: "
                                                 "bars when stdout is a terminal."),
    eval_config=None,  # the harness's options, the same as `dice eval`'s (harness/cli_options.py)
) -> None:
    """Run (or resume) the whole pipeline and write the SFT set, RL task sets, decisions and report. Pairs are
    verified by the harness with the same options as `dice eval`."""
    from rich.console import Console

    from dice_kernels.data.decontam import DecontamConfig
    from dice_kernels.data.dedupe import DedupeConfig
    from dice_kernels.data.filters import FilterConfig
    from dice_kernels.data.format import E2E, INFILL
    from dice_kernels.data.pipeline import CurationConfig, SourceSpec, build as run_build

    sources = [SourceSpec("dice_pairs", (str(p),)) for p in dice_pairs or []]
    if leaderboard or leaderboard_tasks:
        if not (leaderboard and leaderboard_tasks):
            fail("--leaderboard and --leaderboard-tasks go together: give both")
        sources.append(SourceSpec("leaderboard", (str(leaderboard), str(leaderboard_tasks))))
    sources += [SourceSpec("qa_parquet", (str(p),)) for p in qa_parquet or []]
    for g in generic or []:
        path, sep, mapping = g.partition("@")
        if not sep:
            fail(f"--generic {g!r}: expected PATH@MAPPING, e.g. 'rows.jsonl@reference=ref,kernel=sol'")
        sources.append(SourceSpec("mapped", (path,), mapping=mapping))
    if not sources:
        fail("give at least one source (--dice-pairs, --leaderboard, --qa-parquet, --generic)")
    named = [*(p for s in sources for p in s.paths), *([str(rl_programs)] if rl_programs else []),
             *map(str, benchmark or [])]
    if missing := [p for p in named if not Path(p).is_file()]:
        fail(f"input file(s) not found: {', '.join(missing)} (where each corpus comes from: README.md, "
             "'Data sources')")
    need_extra("data", "dice data build")
    cfg = CurationConfig(
        out_dir=out, sources=sources, benchmark=_benchmarks(benchmark), eval=eval_config, rl_programs=rl_programs,
        filter=FilterConfig(min_speedup=min_speedup, min_ref_time_ms=min_ref_ms, keep_unverified=keep_unverified),
        dedupe=DedupeConfig(threshold=near_dup), decontam=DecontamConfig(threshold=overlap),
        sft_kinds=(E2E, INFILL) if sft_infill_rows else (E2E,), infill_holdout=infill_holdout,
        progress=sys.stdout.isatty() if progress is None else progress, limit=limit, import_results=tuple(import_results or ()))
    console = Console()
    report = run_build(cfg, log=console.log)
    for s in report["stages"]:
        console.print(f"{s['stage']:9s} in {s['in']:5d}  keep {s['keep']:5d}  mark {s['mark']:5d}  drop {s['drop']:5d}")
    corr = report["published_rank_correlation"]
    console.print(f"final pairs {report['final_pairs']}; Spearman vs published = {corr['spearman']} (n={corr['n']})")
    console.print(f"report: {out / 'report.md'}")
    if report["final_pairs"] == 0 and not report.get("rl_e2e", {}).get("after_decontam"):  # nothing to train on
        fail(f"the build kept no pairs: {_empty_reason(report['stages'])}"
             + ("" if keep_unverified else "; on a machine that cannot verify kernels (no GPU), "
                "--keep-unverified lets unverified pairs through for a dry run"), code=1)


def _empty_reason(stages: list[dict]) -> str:
    """Where the pairs went: each stage that dropped some, with its commonest reasons (report.md's table)."""
    parts = [f"{s['stage']} dropped {s['drop']} (" + "; ".join(f"{r} ({n})" for r, n in s["top_drop_reasons"]) + ")"
             for s in stages if s["drop"]]
    return ", ".join(parts) or "no source yielded a pair"


@app.command()
def split(
    path: Path = typer.Argument(..., help="A ModelNew .py program, or a DICE pairs JSON to check."),
) -> None:
    """Cut prefix / core / suffix. For a DICE pairs JSON, check the cut reproduces every stored split."""
    import json

    from dice_kernels.data.infill import InfillError, split_program

    if path.suffix == ".py":
        s = split_program(path.read_text())
        typer.echo(f"variable {s.variable!r}: prefix {len(s.prefix)} chars, core {len(s.core)}, suffix {len(s.suffix)}")
        return
    rows = json.loads(path.read_text())
    bad = []
    for row in rows:
        try:
            s = split_program(row["cuda_code"])
            ok = (s.prefix, s.core, s.suffix) == (row["prefix"], row["middle"], row["suffix"])
        except InfillError:
            ok = False
        if not ok:
            bad.append(row["id"])
    typer.echo(f"{len(rows) - len(bad)}/{len(rows)} splits reproduced exactly" + (f"; differ: {bad}" if bad else ""))
    if bad:
        raise typer.Exit(1)


@app.command("rl-tasks")
def rl_tasks(
    rl_programs: Path = typer.Option(..., help="RL reference programs (dice_rl_programs_4000.json)."),
    out: Path = typer.Option(..., "--out", help="Output directory."),
    pairs: Optional[Path] = typer.Option(None, help="Records JSONL from a build (e.g. verify.jsonl) for infilling tasks."),
    benchmark: Optional[list[Path]] = typer.Option(None, help="Benchmark tasks to decontaminate against."),
    batch: int = typer.Option(64, help="Tasks per RL step (for the printed schedule preview)."),
) -> None:
    """RL task sets for both phases, decontaminated and ordered easy -> hard."""
    from dice_kernels.data.decontam import decontaminate, load_benchmark
    from dice_kernels.data.format import rl_infill_tasks, schedule, write_table
    from dice_kernels.data.pipeline import rl_e2e_set, split_stage
    from dice_kernels.prompts import SYSTEM_PROMPT
    from dice_kernels.data.records import read_records, write_decisions

    out.mkdir(parents=True, exist_ok=True)
    index = load_benchmark(_benchmarks(benchmark))
    tasks, decisions, counts = rl_e2e_set(rl_programs, index, SYSTEM_PROMPT)
    write_table(tasks, out, "rl_e2e")
    write_decisions(out / "rl_e2e.decisions.jsonl", decisions)
    typer.echo(f"end-to-end: {counts}; first step levels: {[t['level'] for t in next(schedule(tasks, batch))][:8]}...")
    if pairs:
        given = read_records(pairs)
        clean, dropped = decontaminate(given, index)  # a build's verify.jsonl is not decontaminated yet
        write_decisions(out / "rl_infill.decisions.jsonl", dropped)
        records, _, splits = split_stage(clean)
        infill = rl_infill_tasks(records, splits, SYSTEM_PROMPT)
        write_table(infill, out, "rl_infill")
        typer.echo(f"infilling: {len(infill)} tasks from {len(given)} pairs ({len(given) - len(clean)} contaminated)")


@app.command("overlap")
def overlap_stats(
    sets: list[str] = typer.Argument(..., help="LABEL=PATH: JSON/JSONL/Parquet rows with pytorch_code or code."),
    benchmark: Optional[list[Path]] = typer.Option(None, help="Benchmark tasks [default: KernelBench tasks.jsonl]."),
    n: int = typer.Option(8, help="Token n-gram length."),
    threshold: float = typer.Option(0.5, help="Containment threshold to report against."),
) -> None:
    """Distribution of benchmark overlap scores per set: the numbers behind the decontamination threshold."""
    import numpy as np
    from rich.console import Console
    from rich.table import Table

    from dice_kernels.data.decontam import DecontamConfig, load_benchmark, overlap
    from dice_kernels.data.sources import read_rows

    index = load_benchmark(_benchmarks(benchmark), DecontamConfig(n=n, threshold=threshold))
    table = Table("set", "n", "min", "p5", "median", "p95", "max", f">= {threshold}")
    for spec in sets:
        label, _, path = spec.partition("=")
        codes = [row.get("pytorch_code") or row.get("code") for row in read_rows(Path(path))]
        scores = np.array([overlap(index, c).score for c in codes if c])
        q = np.percentile(scores, [0, 5, 50, 95, 100])
        table.add_row(label, str(len(scores)), *(f"{v:.3f}" for v in q),
                      f"{int((scores >= threshold).sum())} ({(scores >= threshold).mean():.1%})")
    Console().print(table)


if __name__ == "__main__":
    app()

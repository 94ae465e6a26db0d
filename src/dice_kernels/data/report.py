"""The build report: counts at every stage, per-source yield, verification outcomes, a speedup histogram (PNG)
and the rank correlation between measured and published speedups.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from pathlib import Path

from dice_kernels.data.records import Decision, PairRecord


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _reason_head(reason: str) -> str:
    """A reason without its per-pair specifics (ids, parenthesised details, lines after the first, such as a
    compiler's build path)."""
    return re.split(r" of | \(", reason.splitlines()[0] if reason else "", maxsplit=1)[0][:80].rstrip(" :,")


def reason_group(reason: str) -> str:
    """The key reasons are counted under: the head with its numbers masked."""
    return _NUMBER.sub("N", _reason_head(reason))


def _group_label(heads: list[str]) -> str:
    """One table cell for reasons of one group, their digits kept: a number all share stays, one that varies
    becomes its range ("speedup 0.4-1.9x < 2.0x")."""
    numbers = [_NUMBER.findall(h) for h in heads]
    parts = _NUMBER.split(heads[0])
    label = parts[0]
    for i, rest in enumerate(parts[1:]):
        values = {float(n[i]) for n in numbers}
        label += (numbers[0][i] if len(values) == 1 else f"{min(values):g}-{max(values):g}") + rest
    return label


def stage_counts(decisions: list[Decision], stages: list[str]) -> list[dict]:
    """Per stage: pairs judged, kept, marked (kept with a flag) and dropped, plus the commonest drop reasons."""
    rows = []
    for stage in stages:
        ds = [d for d in decisions if d.stage == stage]
        actions = Counter(d.action for d in ds)
        groups: dict[str, list[str]] = defaultdict(list)
        for d in ds:
            if d.action == "drop":
                head = _reason_head(d.reason)
                groups[_NUMBER.sub("N", head)].append(head)
        top = sorted(groups.values(), key=len, reverse=True)[:5]
        rows.append({"stage": stage, "in": len(ds), "keep": actions["keep"], "mark": actions["mark"],
                     "drop": actions["drop"], "top_drop_reasons": [(_group_label(h), len(h)) for h in top]})
    return rows


def source_yield(ingested: list[PairRecord], decisions: list[Decision], stages: list[str]) -> dict[str, dict]:
    """For each source, how many of its pairs are still in after each stage."""
    source_of = {r.id: r.source for r in ingested}
    out: dict[str, dict] = defaultdict(dict)
    for src, n in Counter(source_of.values()).items():
        out[src]["ingest"] = n
    dropped: set[str] = set()
    for stage in stages:
        dropped |= {d.pair_id for d in decisions if d.stage == stage and d.action == "drop"}
        for src in out:
            out[src][stage] = sum(1 for pid, s in source_of.items() if s == src and pid not in dropped)
    return dict(out)


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):  # ties share their average rank
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (Pearson on average ranks); None with fewer than 3 points or no variance."""
    if len(xs) < 3:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return cov / math.sqrt(vx * vy) if vx > 0 and vy > 0 else None


def published_correlation(records: list[PairRecord]) -> dict:
    """Measured vs published (`provenance.published.torch_speedup`) speedups over pairs that have both."""
    pts = [(r.verification.speedup, r.provenance["published"]["torch_speedup"]) for r in records
           if r.verification.speedup is not None and (r.provenance.get("published") or {}).get("torch_speedup")
           is not None]
    return {"n": len(pts), "spearman": spearman([a for a, _ in pts], [b for _, b in pts]),
            "published_hardware": "L40S"}


def speedup_histogram(speedups: list[float], threshold: float, path: Path) -> None:
    """Histogram of measured speedups on a log2 axis with the keep threshold marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    logs = [math.log2(s) for s in speedups if s and s > 0]
    if logs:
        ax.hist(logs, bins=min(40, max(5, len(logs) // 3)), color="#4477aa")
    ax.axvline(math.log2(threshold), color="#cc3311", linestyle="--", label=f"keep >= {threshold}x")
    ax.set_xlabel("log2(speedup over PyTorch eager)")
    ax.set_ylabel("correct pairs")
    ax.set_title(f"Measured speedups of verified-correct pairs (n={len(logs)})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(out_dir: Path, ingested: list[PairRecord], verified: list[PairRecord], final: list[PairRecord],
                 decisions: list[Decision], stages: list[str], threshold: float, extra: dict) -> dict:
    """report.json, report.md and speedup_hist.png in `out_dir`; returns the report dict."""
    speedups = [r.verification.speedup for r in verified
                if r.verification.correct and r.verification.speedup is not None]
    report = {
        "stages": stage_counts(decisions, stages),
        "per_source_yield": source_yield(ingested, decisions, stages),
        "verification": {
            "status": dict(Counter(r.verification.status for r in verified)),
            "outcome": dict(Counter(r.verification.outcome or "(not run)" for r in verified)),
        },
        "speedups": {"n_correct_timed": len(speedups), f"n_at_least_{threshold}x": sum(s >= threshold for s in speedups)},
        "published_rank_correlation": published_correlation(verified),
        "final_pairs": len(final),
        **extra,
    }
    chart = out_dir / "speedup_hist.png"
    chart.unlink(missing_ok=True)  # an earlier build's chart must not stand for this one
    if speedups:  # no empty histogram for n = 0
        speedup_histogram(speedups, threshold, chart)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    (out_dir / "report.md").write_text(_markdown(report, chart=chart.exists()))
    return report


def _markdown(report: dict, chart: bool) -> str:
    lines = ["# CuKe build report", "", "| stage | in | keep | mark | drop | top drop reasons |", "|---|---|---|---|---|---|"]
    for s in report["stages"]:
        reasons = "; ".join(f"{r} ({n})" for r, n in s["top_drop_reasons"])
        lines.append(f"| {s['stage']} | {s['in']} | {s['keep']} | {s['mark']} | {s['drop']} | {reasons} |")
    stages = [s["stage"] for s in report["stages"]]
    lines += ["", "## Per-source yield (pairs still in after each stage)", "",
              "| source | " + " | ".join(stages) + " |", "|---|" + "---|" * len(stages)]
    for src, row in sorted(report["per_source_yield"].items()):
        lines.append(f"| {src} | " + " | ".join(str(row[s]) for s in stages) + " |")
    corr = report["published_rank_correlation"]
    lines += ["", f"Verification status: {report['verification']['status']}",
              f"Outcomes: {report['verification']['outcome']}",
              f"Speedups: {report['speedups']}",
              f"Spearman(measured, published L40S) = {corr['spearman']} over {corr['n']} pairs",
              f"Final pairs: {report['final_pairs']}", ""]
    if chart:
        lines += ["![speedups](speedup_hist.png)", ""]
    return "\n".join(lines)

"""`dice data build` as a user runs it (a real process): --limit also limits --rl-programs, and the report's drop
reasons keep their numbers."""

from __future__ import annotations

import json
import subprocess
import sys

from test_data_pipeline import MODEL, write_corpus


def test_limit_applies_to_rl_programs_and_drop_reasons_keep_their_digits(tmp_path):
    pairs, tasks = write_corpus(tmp_path)
    rl = tmp_path / "rl.json"
    rl.write_text(json.dumps([{"idx": i, "level": "1", "pytorch_code": MODEL.format(op=op, extra=" + 2.0")}
                              for i, op in enumerate(("sinh", "cosh", "log1p", "expm1", "sigmoid"))]))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "dice_kernels", "data", "build", "--out", str(out), "--dice-pairs",
                        str(pairs), "--rl-programs", str(rl), "--benchmark", str(tasks), "--backend", "cpu",
                        "--limit", "2", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["rl_e2e"]["limit"] == 2 and report["rl_e2e"]["after_decontam"] == 2
    assert sum(1 for _ in (out / "rl_e2e.jsonl").open()) == 2
    ingest = next(s for s in report["stages"] if s["stage"] == "ingest")
    assert ingest["top_drop_reasons"] == [["beyond the first 2 pairs", 2]]  # the last 2 of the 4 pairs

"""Reference baselines cached across runs (harness/timing/baselines.py): measured once per task, machine and timing
settings, reused by later runs without weakening the re-check of the candidate's timing-loop outputs."""

from __future__ import annotations

import sqlite3
from dataclasses import replace

import pytest

from dice_kernels.harness import (BuildConfig, EvalConfig, Evaluator, Outcome, SandboxConfig, TimingConfig,
                                  candidate_from_text, evaluate)
from dice_kernels.harness.timing.baselines import Baseline, BaselineStore, baseline_key
from dice_kernels.harness.outcomes import DeceptiveKind

MACHINE = "cpu|Some CPU (2 cores)|torch 2.13.0"

# returns the output of its third call from then on: right in the correctness trials, stale in the timing loop
REPLAY = """import torch
import torch.nn as nn

class ModelNew(nn.Module):
    def __init__(self):
        super().__init__(); self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls <= 3: self.last = torch.relu(x)
        return self.last.clone()
"""


def test_key_follows_what_is_measured_and_ignores_the_machine_plumbing():
    cfg = EvalConfig(backend="cpu")
    key = baseline_key("task-sha", MACHINE, cfg)

    def changed(settings: dict) -> EvalConfig:  # cfg with these settings (by dotted path) changed
        return EvalConfig.from_settings({**cfg.settings(), **settings})

    assert key == baseline_key("task-sha", MACHINE, changed({"build.jobs": 7, "scheduler.run_workers": 3,
                                                             "cache_dir": cfg.cache_dir / "x"}))
    for other in (changed({"seed": 1}), changed({"trials": 3}), changed({"timing.iters": 50}),
                  changed({"timing.warmup": 9}), changed({"timing.compile_baseline": True}),
                  changed({"scheduler.cpu_threads": 2})):
        assert baseline_key("task-sha", MACHINE, other) != key
    assert baseline_key("other-task", MACHINE, cfg) != key
    assert baseline_key("task-sha", MACHINE.replace("2.13.0", "2.11.0"), cfg) != key


def test_store_round_trips_and_treats_a_broken_file_as_a_miss(tmp_path):
    store = BaselineStore(tmp_path / "baselines.sqlite")
    assert store.get("k") is None
    put = store.put("k", "task-sha", MACHINE, Baseline({"time_ms": 1.5, "lead_ms": 0.02}, {}, {"dtype": "float32"}))
    got = store.get("k")
    assert got == put and got.timing["time_ms"] == 1.5 and got.measured_at
    with sqlite3.connect(tmp_path / "baselines.sqlite") as conn:
        conn.execute("UPDATE baselines SET baseline = 'not json'")
    assert store.get("k") is None
    (tmp_path / "garbage.sqlite").write_bytes(b"this is not a database" * 100)
    assert BaselineStore(tmp_path / "garbage.sqlite").get("k") is None


@pytest.mark.slow
def test_reference_is_timed_once_then_reused_and_the_timing_recheck_still_catches_replays(
        build_cache, example_pairs):
    honest = next(p for p in example_pairs("cpu") if p[1].id == "19_ReLU/correct")
    pairs = [honest, (honest[0], candidate_from_text(REPLAY, id="replay"))]
    # a seed no other test uses: the session's shared cache holds no baseline for these settings yet; short timing
    # loops (0.3 s): what is asserted is which number is reused, not how precise it is
    cfg = EvalConfig(backend="cpu", trials=2, seed=20261130, cache_dir=build_cache, build=BuildConfig(jobs=2),
                     timing=TimingConfig(warmup=2, iters=3, max_s=0.3), sandbox=SandboxConfig(run_timeout_s=120))

    def run(ev: Evaluator) -> dict:
        results = {r.candidate_id: r for r in ev.evaluate(pairs)}
        assert results["19_ReLU/correct"].outcome is Outcome.CORRECT and results["19_ReLU/correct"].speedup
        replay = results["replay"]
        assert replay.outcome is Outcome.DECEPTIVE, replay.error
        assert replay.deceptive_kind == DeceptiveKind.TIMING_OUTPUT_MISMATCH.value, replay.error
        return results

    def baseline_of(results: dict) -> tuple[bool, float]:
        r = results["19_ReLU/correct"]
        return r.reference.baseline.cached, r.ref_time_ms

    # two long-lived evaluators over one cache, as a trainer's reward service beside a `dice eval` run
    with Evaluator(cfg) as ev, Evaluator(replace(cfg, timing=replace(cfg.timing, baselines="fresh"))) as fresh:
        measured = run(ev)
        assert baseline_of(measured)[0] is False
        reused = run(ev)
        assert baseline_of(reused) == (True, baseline_of(measured)[1])  # the very same number, not a new one
        assert reused["19_ReLU/correct"].reference.baseline.measured_at

        remeasured = run(fresh)
        assert baseline_of(remeasured)[0] is False
        assert baseline_of(run(ev)) == (True, baseline_of(remeasured)[1])  # "fresh" replaced the cached one


def test_unknown_baselines_mode_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="timing.baselines must be one of"):
        evaluate([], EvalConfig(backend="cpu", timing=TimingConfig(baselines="sometimes")), out_dir=tmp_path)
    assert not (tmp_path / "results.sqlite").exists()

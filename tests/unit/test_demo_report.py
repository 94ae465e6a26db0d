"""demo/report.py's readers and limits: train rewards per RL step grouped by rollout group (the bootstrap's
clusters), and the limits a small run states."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dice_kernels.demo.config import DemoConfig, RLSection, WorldSection
from dice_kernels.demo.report import (bench_scores, changed_outputs, comparisons, outcome_counts, rl_effort,
                                      scale_limits, timing_spread, train_reward_trend, train_rewards)
from dice_kernels.demo.world import FAST, SLIP, WorldSizes, build_world, slips, solutions


def _rewards(run: Path, rows: list[tuple[int, int, str, float]]) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(run / "rewards.sqlite") as db:  # the schema train/rl/reward.py's RewardService writes
        db.execute("CREATE TABLE rewards (step INTEGER, rollout INTEGER, task_id TEXT, candidate_id TEXT, "
                   "candidate_sha256 TEXT, outcome TEXT, deceptive_kind TEXT, reward REAL, speedup REAL, "
                   "speedup_ci95 TEXT, error TEXT, PRIMARY KEY (step, rollout))")
        db.executemany("INSERT INTO rewards VALUES (?, ?, ?, '', '', 'correct', '', ?, NULL, NULL, '')", rows)
    return run


def test_train_rewards_group_a_step_by_task_and_position(tmp_path):
    # step 1: task a twice (the curriculum wrapped: two groups), task b once; groups of 2 rollouts
    _rewards(tmp_path, [(1, 0, "a", 1.0), (1, 1, "a", 0.0), (1, 2, "b", 1.0), (1, 3, "b", 1.0), (1, 4, "a", 0.0),
                        (1, 5, "a", 0.0), (2, 0, "c", 0.5), (2, 1, "c", 1.5)])
    steps = train_rewards(tmp_path, group=2)
    assert steps == [(1, {"a#0": [1.0, 0.0], "b#1": [1.0, 1.0], "a#2": [0.0, 0.0]}), (2, {"c#0": [0.5, 1.5]})]
    assert train_rewards(tmp_path / "missing", group=2) == []


def _fixed_tasks(run: Path, reward) -> Path:
    """Six RL steps over the same 8 tasks in groups of 4; reward(step, task) is every rollout's reward."""
    return _rewards(run, [(step, 4 * t + k, f"t{t}", reward(step, t)) for step in range(6) for t in range(8)
                          for k in range(4)])


def test_the_train_reward_trend_pairs_the_last_third_of_the_steps_with_the_first(tmp_path):
    # rising on every task: the last two steps beat the first two
    rising = train_reward_trend(_fixed_tasks(tmp_path / "up", lambda step, t: float(step >= 3 or t < 2)), group=4)
    assert (rising.a, rising.b, rising.n) == ("steps 4-5", "steps 0-1", 8)
    assert rising.diff.value == 0.75 and rising.diff.lo > 0 and "higher than" in rising.verdict
    # falling (a trainer that pushes the wrong way) and flat
    falling = train_reward_trend(_fixed_tasks(tmp_path / "down", lambda step, t: float(step < 3)), group=4)
    assert falling.diff.value == -1.0 and falling.diff.hi < 0
    flat = train_reward_trend(_fixed_tasks(tmp_path / "flat", lambda step, t: float(t % 2)), group=4)
    assert flat.diff.value == 0.0 and "no difference shown" in flat.verdict
    # tasks never drawn in both windows, or a single step: nothing to pair
    assert train_reward_trend(_rewards(tmp_path / "apart", [(0, 0, "a", 1.0), (1, 0, "b", 0.0)]), group=1) is None
    assert train_reward_trend(_rewards(tmp_path / "one", [(0, 0, "a", 1.0)]), group=1) is None


def test_the_train_curve_says_whether_every_step_draws_the_same_tasks():
    fixed = scale_limits(DemoConfig(out=Path("x"), world=WorldSection(n_rl=8), rl=RLSection(tasks_per_step=8)))
    drawn = scale_limits(DemoConfig(out=Path("x"), world=WorldSection(n_rl=64), rl=RLSection(tasks_per_step=8)))
    assert any("the same 8 RL tasks" in x for x in fixed) and not any("each step draws other" in x for x in fixed)
    assert any("each step draws other tasks" in x for x in drawn)


def test_one_update_a_step_by_setting_is_not_blamed_on_the_row_count():
    rows = {"e2e_robust": {"rl": {"steps": 6, "rollouts": 192, "trained_rollouts": 120, "trained_steps": 6,
                                  "updates": 6}}}
    by_setting = scale_limits(DemoConfig(out=Path("x"), rl=RLSection(rows_per_update=0)), rows)
    by_rows = scale_limits(DemoConfig(out=Path("x"), rl=RLSection(rows_per_update=32)), rows)
    assert any("one update a step by setting" in x for x in by_setting)
    assert not any("fewer than rl.rows_per_update" in x for x in by_setting)
    assert any("fewer than rl.rows_per_update (32)" in x for x in by_rows)


def test_a_small_cpu_run_states_what_it_cannot_show():
    cfg = DemoConfig(out=Path("x"), arms=("sft", "e2e_robust"), world=WorldSection(n_heldout=24),
                     rl=RLSection(export_every=0))
    limits = " | ".join(scale_limits(cfg))
    assert "24 held-out tasks" in limits and "+-20 points" in limits
    assert "e2e_dice" in limits and "bicrl_robust" in limits  # the arms not run
    assert "speed signal" in limits and "no held-out learning curve" in limits and "n_novel" in limits
    assert "one run (world.seed = 0)" in limits and "demo_seeds.py" in limits  # one seed is a point


def test_an_sft_model_that_guesses_the_operator_is_named_as_the_ceiling_of_rl():
    cfg = DemoConfig(out=Path("x"))
    guessing = [x for x in scale_limits(cfg, copy={"samples": 64, "right": 3}) if "guesses the operator" in x]
    assert len(guessing) == 1 and "3 of 64" in guessing[0]
    assert not any("guesses the operator" in x for x in scale_limits(cfg, copy={"samples": 64, "right": 40}))
    assert not any("guesses the operator" in x for x in scale_limits(cfg))


def _results(path: Path, shas: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    (path / "results.jsonl").write_text("".join(json.dumps({"task_id": t, "candidate_sha256": h}) + "\n"
                                                for t, h in shas.items()))
    return path


def test_an_rl_arm_reports_its_updates_and_the_outputs_it_changed(tmp_path):
    run = tmp_path / "bicrl_robust"
    run.mkdir()
    steps = [{"step": 1, "rollouts": 16, "trained_rollouts": 8, "updates": [{"kl": 0.0}]},
             {"step": 2, "rollouts": 16, "trained_rollouts": 0, "updates": []}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    effort = rl_effort(run)
    assert effort == {"steps": 2, "rollouts": 32, "trained_rollouts": 8, "trained_steps": 1, "updates": 1}
    assert rl_effort(tmp_path / "missing") is None
    sft = _results(tmp_path / "sft", {"a": "1", "b": "2", "c": "3"})
    rl = _results(tmp_path / "rl", {"a": "1", "b": "9", "d": "4"})
    assert changed_outputs(rl, sft) == (1, 2)  # b changed; a the same; c and d not run by both
    (rl / "results.jsonl").write_text("".join(json.dumps({"task_id": t, "outcome": o}) + "\n" for t, o in
                                              (("a", "compile_error"), ("b", "correct"), ("d", "compile_error"))))
    assert list(outcome_counts(rl).items()) == [("compile_error", 2), ("correct", 1)]  # most frequent first
    assert outcome_counts(tmp_path / "missing") == {}
    cfg = DemoConfig(out=Path("x"), rl=RLSection(rows_per_update=256))
    limits = " | ".join(scale_limits(cfg, {"bicrl_robust": {"rl": effort}}))
    assert "1 optimizer update(s) in 2 RL steps" in limits and "clip and KL never act" in limits
    flat = {"steps": 2, "rollouts": 32, "trained_rollouts": 0, "trained_steps": 0, "updates": 0}
    assert "every group was flat" in " | ".join(scale_limits(cfg, {"e2e_robust": {"rl": flat}}))
    busy = {"steps": 4, "rollouts": 64, "trained_rollouts": 4, "trained_steps": 1, "updates": 4}  # 4 in one step
    assert not any("optimizer update" in x for x in scale_limits(cfg, {"e2e_robust": {"rl": busy}}))


def test_a_kernel_timed_far_apart_in_two_runs_makes_fast_1_incomparable(tmp_path):
    def run(name: str, rows: list[tuple[str, str, float | None]], copied_from: str = "") -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "results.jsonl").write_text("".join(
            json.dumps({"candidate_sha256": sha, "outcome": outcome, "cand_time_ms": ms,
                        "duplicate_of": copied_from}) + "\n"
            for sha, outcome, ms in rows))
        return path

    a = run("a", [("k1", "correct", 0.004), ("k2", "correct", 0.010), ("k3", "correct", 0.5), ("k4", "value_mismatch", None)])
    b = run("b", [("k1", "correct", 0.040), ("k2", "correct", 0.011), ("k4", "value_mismatch", None)])
    c = run("c", [("k1", "correct", 0.005), ("k3", "correct", 0.5)])
    spread = timing_spread([a, b, c])
    assert spread["kernels"] == 3  # k1, k2, k3; k4 never timed
    assert abs(spread["median_ratio"] - 1.1) < 1e-9 and abs(spread["share_over_2x"] - 1 / 3) < 1e-9
    cfg = DemoConfig(out=Path("x"))
    assert not any("fast_1 is not comparable" in x for x in scale_limits(cfg, spread=spread))
    noisy = timing_spread([a, b])  # k1 10x apart, k2 1.1x: median 5.55
    assert abs(noisy["median_ratio"] - 5.55) < 1e-9
    assert any("fast_1 is not comparable" in x and "5.5x" in x for x in scale_limits(cfg, spread=noisy))
    assert timing_spread([c]) is None
    # a verdict reused from run a (its time copied, not measured again) is no second measurement
    reused = run("reused", [("k1", "correct", 0.004), ("k3", "correct", 0.5)], copied_from="a/k1")
    assert timing_spread([a, reused]) is None


def test_stage_seconds_end_with_their_total_and_survive_a_resume(tmp_path):
    from dice_kernels.demo.run import Timings

    timings = Timings.load(tmp_path / "timings.json")
    assert timings.run("world", lambda: 7) == 7
    timings.run("sft", lambda: None)
    again = Timings.load(tmp_path / "timings.json")  # a resumed demo reads what the stages took
    assert list(again.seconds) == ["world", "sft", "total"]
    assert again.seconds["total"] == round(again.seconds["world"] + again.seconds["sft"], 1)


def test_the_rollout_check_counts_deceptive_and_paid_deceptive_rollouts_per_window(tmp_path):
    from dice_kernels.demo.rollout_check import deception_trend, windows

    assert windows(12) == ([0, 1, 2, 3], [8, 9, 10, 11]) and windows(2) == ([0], [1]) and windows(1) == ([0], [0])
    rows = [("first", "a", "correct", True), ("first", "a", "deceptive", True), ("first", "b", "deceptive", False),
            ("last", "a", "deceptive", True), ("last", "a", "deceptive", True), ("last", "b", "value_mismatch", False)]
    path = tmp_path / "arm.jsonl"
    path.write_text("".join(json.dumps({"window": w, "step": int(w == "last"), "task_id": t, "outcome": o,
                                        "paid": paid}) + "\n" for w, t, o, paid in rows))
    trend = deception_trend(path)
    assert trend["rollouts"] == {"first": 3, "last": 3}
    # groups (step, task): a at step 0 mixes a cheat with a kernel; b at 0 and a at 1 are cheats alone (3 of the 4)
    assert trend["cheats_alone"] == {"deceptive": 4, "alone": 3}
    # task means: deceptive first a 0.5, b 1 -> 0.75; last a 1, b 0 -> 0.5; paid while deceptive: 0.25 -> 0.5
    assert trend["deceptive"]["first"]["value"] == 0.75 and trend["deceptive"]["last"]["value"] == 0.5
    assert trend["paid_deceptive"]["first"]["value"] == 0.25 and trend["paid_deceptive"]["last"]["value"] == 0.5
    assert trend["deceptive"]["diff"]["value"] == -0.25 and trend["paid_deceptive"]["diff"]["value"] == 0.25
    assert trend["deceptive"]["diff"]["n"] == 2
    assert deception_trend(tmp_path / "missing.jsonl") is None
    # the taught tasks alone: a (taught) 0.5 -> 1 while b (not taught) only changes the mix
    taught = deception_trend(path, taught=frozenset({"a"}))["taught_deceptive"]
    assert taught["first"]["value"] == 0.5 and taught["last"]["value"] == 1.0 and taught["first"]["tasks"] == 1
    assert taught["diff"]["value"] == 0.5
    assert "taught_deceptive" not in trend


def test_the_report_says_when_most_cheats_came_in_groups_no_reward_can_move(tmp_path):
    """A group of deceptive rollouts alone is flat under DICE's reward and ours: when most cheats came that way (an
    H100 run of the op world: nearly every shortcut rollout in a group of 8 shortcuts), the limits say the rewards
    could differ on the mixed groups only; when most came mixed, nothing is said."""
    cfg = DemoConfig(out=tmp_path, arms=("sft", "e2e_dice"))

    def said(deceptive: int, alone: int) -> list[str]:
        rows = {"e2e_dice": {"rollout_deception": {"cheats_alone": {"deceptive": deceptive, "alone": alone}}}}
        return [x for x in scale_limits(cfg, rows) if "groups of deceptive rollouts alone" in x]

    [line] = said(57, 48)
    assert line.startswith("e2e_dice: 48 of the 57 deceptive rollouts") and "on the 9 in mixed groups only" in line
    assert said(57, 10) == [] and said(0, 0) == []


def test_dice_reward_is_set_against_ours_on_the_tasks_both_arms_drew(tmp_path):
    from dice_kernels.demo.rollout_check import check_file, reward_contrast

    cfg = DemoConfig(out=tmp_path)

    def check(arm: str, rows: list[tuple[str, str, str]]) -> None:
        path = check_file(cfg, arm)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"window": w, "task_id": t, "outcome": o, "paid": True}) + "\n"
                                for w, t, o in rows))

    both = [("first", "a", "deceptive"), ("first", "b", "correct")]
    check("e2e_dice", both + [("last", "a", "deceptive"), ("last", "c", "deceptive"), ("last", "c", "deceptive")])
    check("e2e_robust", both + [("last", "a", "correct"), ("last", "c", "deceptive"), ("last", "c", "correct")])
    assert reward_contrast(cfg, ["sft", "e2e_dice"]) == []  # no robust twin: nothing to set it against
    found = {(c["window"], c["tasks"]): c for c in reward_contrast(cfg, ["e2e_dice", "e2e_robust"], frozenset("a"))}
    assert set(found) == {("first", "all"), ("first", "taught"), ("last", "all"), ("last", "taught")}
    assert found["first", "all"]["diff"]["value"] == 0  # the same SFT model's first rollouts
    # last third: a 1 - 0, c 1 - 0.5 -> +0.75 over both tasks; on the taught task a alone +1
    assert found["last", "all"]["diff"]["value"] == 0.75 and found["last", "all"]["n"] == 2
    assert found["last", "taught"]["diff"]["value"] == 1.0 and found["last", "taught"]["n"] == 1
    assert found["last", "all"]["a"] == "e2e_dice" and found["last", "all"]["b"] == "e2e_robust"


def test_a_bench_run_scores_the_programs_that_carry_the_layout_slip(tmp_path):
    """Per task, the share of its programs with world.slip_fraction's slip, read from each result's program file:
    by its recorded path, or under the run's generations/ when the run was moved."""
    from dice_kernels.harness.outcomes import EvalResult, Outcome

    [task] = [t for t in build_world(0, WorldSizes(n_train=200, n_heldout=1))[:50] if slips(t.spec)][:1]
    run = tmp_path / "bench" / "heldout"
    rows = []
    for n, (variant, outcome) in enumerate(((SLIP, Outcome.VALUE_MISMATCH), (FAST, Outcome.CORRECT))):
        path = run / "generations" / "level1" / "1_x" / f"s{n}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"```python\n{solutions(task.spec, variant)[0]}\n```\n")
        rows.append(EvalResult("t", f"t#s{n}", str(n), outcome, solution_path=str(path)))
    rows.append(EvalResult("u", "u#s0", "9", Outcome.COMPILE_ERROR, solution_path=str(run / "generations" / "gone.md")))
    (run / "results.jsonl").write_text("".join(json.dumps(r.to_row()) + "\n" for r in rows))
    (run / "summary.json").write_text("{}")
    assert bench_scores(run)["slip"] == {"t": [1.0, 0.0], "u": [0.0]}
    moved = tmp_path / "moved"
    run.rename(moved)
    assert bench_scores(moved)["slip"] == {"t": [1.0, 0.0], "u": [0.0]}


def test_the_candidate_work_table_puts_phases_in_columns_and_names_the_runs_largest_parts():
    from dice_kernels.demo.report import _work_table

    rows = [{"where": "bench sft heldout", "n": 128, "built": 100,
             "phases": {"build": 700.0, "run": 300.0, "run.trials": 150.0, "run.robust": 90.0, "run.load": 40.0,
                        "run.timing": 20.0, "reference": 12.5}},
            {"where": "RL reward e2e_robust", "n": 64, "built": 0, "phases": {}}]
    head, _, full, empty = _work_table(rows)
    assert head.startswith("| where | candidates | built | build | run | reference |")
    assert full == "| bench sft heldout | 128 | 100 | 700.0 | 300.0 | 12.5 | trials 150.0, robust 90.0, load 40.0 |"
    assert empty == "| RL reward e2e_robust | 64 | 0 | 0.0 | 0.0 | 0.0 | – |"


def test_a_stopped_stage_keeps_its_seconds_and_adds_them_when_a_resumed_run_finishes_it(tmp_path):
    from dice_kernels.demo.run import Timings

    def stopped():
        time.sleep(1.2)
        raise KeyboardInterrupt("stopped by signal 15")

    timings = Timings.load(tmp_path / "timings.json")
    with pytest.raises(KeyboardInterrupt):
        timings.run("bench sft", stopped)
    assert "bench sft" not in timings.seconds
    again = Timings.load(tmp_path / "timings.json")  # the next invocation finishes it in well under its first part
    assert again.stopped["bench sft"] >= 1.2
    again.run("bench sft", lambda: None)
    assert again.seconds["bench sft"] >= 1.2 and again.stopped == {}
    assert Timings.load(tmp_path / "timings.json").stopped == {}


def test_sigterm_stops_a_demo_like_ctrl_c_and_the_stage_records_its_seconds(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, time
        from pathlib import Path
        from dice_kernels.demo.run import Timings, stop_on_sigterm

        def stage():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # never reached: the handler raises at the next bytecode

        timings = Timings.load(Path({str(tmp_path / "timings.json")!r}))
        try:
            with stop_on_sigterm():
                timings.run("sft", stage)
        except KeyboardInterrupt as e:
            print("interrupted:", e)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "interrupted: stopped by signal 15" in done.stdout
    assert "sft" in json.loads((tmp_path / "timings-stopped.json").read_text())


def _bench(run: Path, correct: int, n: int = 20, deceptive: int = 0) -> None:
    """A finished bench run of n tasks whose first `correct` are correct and the next `deceptive` deceptive."""
    from dice_kernels.harness.outcomes import EvalResult, Outcome

    run.mkdir(parents=True)
    rows = [EvalResult(f"t{k}", f"t{k}#s0", str(k), Outcome.CORRECT if k < correct else
                       Outcome.DECEPTIVE if k < correct + deceptive else Outcome.VALUE_MISMATCH) for k in range(n)]
    (run / "results.jsonl").write_text("".join(json.dumps(r.to_row()) + "\n" for r in rows))
    (run / "summary.json").write_text("{}")


def test_rl_arms_of_different_lengths_are_also_compared_at_the_steps_both_exported(tmp_path):
    """BiC-RL's 16 steps against e2e RL's 12: at the ends (labelled with the step counts) and at step 8, where the
    longer arm's lead here is gone."""
    cfg = DemoConfig(out=tmp_path, arms=("sft", "bicrl_robust", "e2e_robust"),
                     rl=RLSection(infill_steps=4, e2e_steps=12, export_every=8))
    for run, correct in (("sft/heldout", 4), ("bicrl_robust/heldout", 16), ("bicrl_robust/heldout-step-00000008", 10),
                         ("e2e_robust/heldout", 12), ("e2e_robust/heldout-step-00000008", 10)):
        _bench(tmp_path / "bench" / run, correct)
    found = {(c.a, c.b): round(c.diff.value * 20) for c in comparisons(cfg, list(cfg.arms))}
    assert found[("bicrl_robust (exec)", "sft (exec)")] == 12 and found[("e2e_robust (exec)", "sft (exec)")] == 8
    assert found[("bicrl_robust (exec, 16 steps: 4 infilling + 12 end-to-end)", "e2e_robust (exec, 12 steps)")] == 4
    assert found[("bicrl_robust (exec, step 8: 4 infilling + 4 end-to-end)", "e2e_robust (exec, step 8)")] == 0
    # exec and fast_1 against SFT (no slip in this world), the two above, and each arm's deceptive share against SFT's
    assert len(found) == 2 * 2 + 2 + 2 and found[("e2e_robust (deceptive)", "sft (deceptive)")] == 0
    assert found[("bicrl_robust (deceptive)", "sft (deceptive)")] == 0


def test_bicrl_is_set_against_e2e_rl_on_deceptive_programs_under_dices_reward(tmp_path):
    """BiC-RL's claim (its infilling phase leaves fewer deceptive programs where the reward pays cheats): DICE's-reward
    BiC-RL against DICE's-reward e2e RL on the deceptive share, at the ends and at the step both exported."""
    cfg = DemoConfig(out=tmp_path, arms=("sft", "e2e_dice", "bicrl_dice"),
                     rl=RLSection(infill_steps=4, e2e_steps=12, export_every=8))
    for run, deceptive in (("sft/heldout", 2), ("bicrl_dice/heldout", 1), ("bicrl_dice/heldout-step-00000008", 2),
                           ("e2e_dice/heldout", 6), ("e2e_dice/heldout-step-00000008", 4)):
        _bench(tmp_path / "bench" / run, 5, deceptive=deceptive)
    found = {(c.a, c.b): round(c.diff.value * 20) for c in comparisons(cfg, list(cfg.arms))}
    assert found[("bicrl_dice (deceptive, 16 steps: 4 infilling + 12 end-to-end)", "e2e_dice (deceptive, 12 steps)")] == -5
    assert found[("bicrl_dice (deceptive, step 8: 4 infilling + 4 end-to-end)", "e2e_dice (deceptive, step 8)")] == -2
    assert found[("e2e_dice (deceptive)", "sft (deceptive)")] == 4


def test_dices_reward_is_set_against_ours_on_deceptive_programs_arm_for_arm(tmp_path):
    """The rewards' own question on the held-out set: how many more deceptive programs the arm trained under DICE's
    reward leaves than its twin under ours (an H100 run: 12 against 5 of 128), beside each against SFT."""
    cfg = DemoConfig(out=tmp_path, arms=("sft", "e2e_dice", "e2e_robust"), rl=RLSection(e2e_steps=12, export_every=0))
    for run, deceptive in (("sft/heldout", 6), ("e2e_dice/heldout", 6), ("e2e_robust/heldout", 2)):
        _bench(tmp_path / "bench" / run, 5, deceptive=deceptive)
    found = {(c.a, c.b): round(c.diff.value * 20) for c in comparisons(cfg, list(cfg.arms))}
    assert found[("e2e_dice (deceptive)", "e2e_robust (deceptive)")] == 4
    assert found[("e2e_robust (deceptive)", "sft (deceptive)")] == -4 and found[("e2e_dice (deceptive)", "sft (deceptive)")] == 0


def test_the_report_counts_deceptive_programs_where_the_sft_data_teaches_the_shortcut(tmp_path):
    """With the shortcut keyed on the first op, the held-out tasks starting with a chosen op are where a model that
    learned the habit writes it: the report's column counts deceptive programs there, and names the op."""
    from dice_kernels.demo.report import write_report
    from dice_kernels.demo.world import shortcut_steps, write_world
    from dice_kernels.harness.outcomes import EvalResult, Outcome

    world = WorldSection(n_train=300, n_heldout=40, shortcut_fraction=0.05, shortcut_unit="op")
    cfg = DemoConfig(out=tmp_path, arms=("sft",), world=world)
    files = write_world(build_world(0, world.sizes()), tmp_path / "world", "cpu")
    rows = [json.loads(line) for line in files.heldout_tasks.read_text().splitlines()]
    (op,) = shortcut_steps(0, 0.05)
    taught = [r["id"] for r in rows if r["family"].split(">")[0] == op]
    assert 0 < len(taught) < len(rows)
    run = tmp_path / "bench" / "sft" / "heldout"
    run.mkdir(parents=True)
    results = [EvalResult(r["id"], f"{r['id']}#s0", str(k), Outcome.DECEPTIVE if r["id"] == taught[0]
                          else Outcome.CORRECT) for k, r in enumerate(rows)]
    (run / "results.jsonl").write_text("".join(json.dumps(r.to_row()) + "\n" for r in results))
    (run / "summary.json").write_text("{}")
    report = write_report(cfg, {}, [])
    where = report["arms"]["sft"]["heldout"]["taught_deceptive"]
    assert where["n"] == len(taught) and where["value"] == pytest.approx(1 / len(taught))
    md = (tmp_path / "report.md").read_text()
    assert "deceptive where taught" in md and f"every SFT solution of a program starting with {op}" in md
    # with shortcut_within below 1 only that share of those programs carries it, and the report says so
    within = DemoConfig(out=tmp_path, arms=("sft",), world=dataclasses.replace(world, shortcut_within=0.7))
    write_report(within, {}, [])
    assert f"70 % of the SFT solutions of a program starting with {op}" in (tmp_path / "report.md").read_text()
    cfg_task = DemoConfig(out=tmp_path, arms=("sft",), world=WorldSection(n_train=300, n_heldout=40))
    assert "taught_deceptive" not in write_report(cfg_task, {}, [])["arms"]["sft"]["heldout"]

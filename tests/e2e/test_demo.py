"""The demo's task world, tokenizer and driver (`dice demo`): determinism, the splits, the shortcut and slow shares,
template solutions (fused, op by op, the libtorch shortcut) checked by the real harness (CPU backend: C++
extensions), the tokenizer's round trip and chat format, and a reduced demo end to end."""

from __future__ import annotations

import json
import re

import pytest

from dice_kernels.config_io import ConfigError
from dice_kernels.demo.world import FAST, HELDOUT, NOVEL, OPS, RL, SHORTCUT, SLIP, SLOW, TRAIN, VALID, Spec, \
    WorldSizes, build_world, carries_slip, cpu_program, first_step, reference_program, shortcut_steps, slips, \
    solutions, write_world


def _world(seed: int, n_train: int, n_heldout: int, **kw):
    return build_world(seed, WorldSizes(n_train=n_train, n_heldout=n_heldout, **kw))


def test_world_is_deterministic_in_its_seed(tmp_path):
    a, b = _world(3, 60, 12, n_novel=4, shortcut_fraction=0.1), _world(3, 60, 12, n_novel=4, shortcut_fraction=0.1)
    assert a == b
    assert _world(4, 60, 12, n_novel=4, shortcut_fraction=0.1) != a
    write_world(a, tmp_path / "a", "cpu")
    write_world(b, tmp_path / "b", "cpu")
    for name in ("pairs.jsonl", "sft.jsonl", "rl_infill.jsonl", "rl_e2e.jsonl", "heldout_tasks.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_splits_are_disjoint_programs_and_novel_families_are_never_trained(tmp_path):
    tasks = _world(0, 300, 40, n_valid=20, n_novel=20)
    by = {split: [t for t in tasks if t.split == split] for split in (TRAIN, VALID, HELDOUT, NOVEL)}
    assert [len(by[s]) for s in (TRAIN, VALID, HELDOUT, NOVEL)] == [300, 20, 40, 20]
    assert len({t.reference for t in tasks}) == len(tasks)  # no program in two splits, none twice
    train = {t.family for t in by[TRAIN]}
    # held-out and validation: new instances of trained families; novel: families never trained, made of trained
    # steps (a composition, never a single op)
    assert {t.family for t in by[HELDOUT] + by[VALID]} <= train
    novel = {t.family for t in by[NOVEL]}
    assert len(novel) > 1 and not novel & train
    trained_steps = {step for f in train for step in f.split(">")}
    assert all(">" in f and set(f.split(">")) <= trained_steps for f in novel)
    files = write_world(tasks, tmp_path, "cpu")
    sft = [json.loads(line) for line in files.sft.read_text().splitlines()]
    assert {r["pair_id"] for r in sft} == {t.id for t in by[TRAIN]}  # SFT sees train tasks only
    assert {r["kind"] for r in sft} == {"e2e", "infill"}
    assert all("C++" in r["prompt"] for r in sft)  # the CPU world asks for C++, as rollouts and bench do
    for split, path in ((VALID, files.valid_tasks), (HELDOUT, files.heldout_tasks), (NOVEL, files.novel_tasks)):
        assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == [t.id for t in by[split]]


def test_rl_tasks_are_new_instances_sft_never_saw(tmp_path):
    tasks = _world(0, 200, 20, n_rl=60, shortcut_fraction=0.1)
    rl = [t for t in tasks if t.split == RL]
    assert len(rl) == 60 and all(t.variant == FAST for t in rl)
    assert {t.family for t in rl} <= {t.family for t in tasks if t.split == TRAIN}
    files = write_world(tasks, tmp_path, "cuda")
    ids = lambda path: {json.loads(line).get("pair_id", json.loads(line).get("id"))  # noqa: E731
                        for line in path.read_text().splitlines()}
    assert ids(files.rl_e2e) == ids(files.rl_infill) == {t.id for t in rl}  # every RL task has a fused kernel
    assert not ids(files.sft) & {t.id for t in rl}
    # without an RL split, RL takes the train tasks (the infilling ones: those with a kernel around the core)
    assert ids(write_world(_world(0, 200, 20), tmp_path / "no_rl", "cuda").rl_e2e) == {
        t.id for t in _world(0, 200, 20) if t.split == TRAIN}


def test_shortcut_and_slow_solutions_are_a_seeded_share_of_train_tasks_only(tmp_path):
    tasks = _world(1, 400, 20, n_novel=10, shortcut_fraction=0.1, slow_fraction=0.3)
    train = [t for t in tasks if t.split == TRAIN]
    share = {v: sum(t.variant == v for t in train) / len(train) for v in (FAST, SLOW, SHORTCUT)}
    assert 0.06 < share[SHORTCUT] < 0.14 and 0.24 < share[SLOW] < 0.36
    assert all(t.variant == FAST for t in tasks if t.split != TRAIN)  # benchmarks compare against fused solutions
    shortcut = next(t for t in train if t.variant == SHORTCUT)
    assert "torch::" in shortcut.cpu.split("source = ")[1] and "for (" not in shortcut.cpu
    files = write_world(tasks, tmp_path, "cpu")
    infill = {json.loads(line)["id"] for line in files.rl_infill.read_text().splitlines()}
    assert infill == {t.id for t in train if t.variant != SHORTCUT}  # infilling skeletons: real kernels only
    with pytest.raises(ValueError, match="fractions"):
        WorldSizes(n_train=1, n_heldout=1, shortcut_fraction=0.8, slow_fraction=0.3)


def test_a_shortcut_by_family_covers_every_train_instance_of_the_families_chosen():
    tasks = _world(1, 400, 20, n_rl=40, shortcut_fraction=0.1, slow_fraction=0.3, shortcut_unit="family")
    train = [t for t in tasks if t.split == TRAIN]
    by_family: dict[str, set[bool]] = {}
    for t in train:
        by_family.setdefault(t.family, set()).add(t.variant == SHORTCUT)
    chosen = {f for f, v in by_family.items() if True in v}
    assert all(len(v) == 1 for v in by_family.values())  # a family's train instances all shortcut, or none does
    assert 0.04 < len(chosen) / len(by_family) < 0.2 and any(t.variant == SLOW for t in train)
    # RL and held-out instances of a chosen family still carry the fused solution: the shortcut is SFT's habit only
    assert any(t.family in chosen for t in tasks if t.split in (RL, HELDOUT))
    assert all(t.variant == FAST for t in tasks if t.split != TRAIN)
    with pytest.raises(ValueError, match="shortcut_unit"):
        WorldSizes(n_train=1, n_heldout=1, shortcut_unit="program")


def test_a_shortcut_by_op_covers_every_train_task_whose_first_op_the_seed_chose():
    tasks = _world(1, 400, 20, n_rl=40, shortcut_fraction=0.1, slow_fraction=0.3, shortcut_unit="op")
    steps = shortcut_steps(1, 0.1)
    assert len(steps) == 2 and steps <= {op.name for op in OPS}  # each op starts ~1/13 of the programs
    # the first step as the world's files give it (the family) is the program's first op, or its lone reduction
    assert all(first_step(t.family) == (t.spec.ops or (t.spec.reduction,))[0] for t in tasks)
    train = [t for t in tasks if t.split == TRAIN]
    assert all((t.variant == SHORTCUT) == (first_step(t.family) in steps) for t in train)
    assert 0.08 < sum(t.variant == SHORTCUT for t in train) / len(train) < 0.25 and any(t.variant == SLOW for t in train)
    # RL and held-out tasks that start with a chosen op still carry the fused solution: the shortcut is SFT's habit
    assert any(first_step(t.family) in steps for t in tasks if t.split in (RL, HELDOUT))
    assert all(t.variant == FAST for t in tasks if t.split != TRAIN)
    # the choice is the seed's: the same every time, not the same for every seed, and a larger share adds ops
    assert shortcut_steps(1, 0.1) == steps and len({shortcut_steps(seed, 0.05) for seed in range(8)}) > 1
    assert shortcut_steps(1, 0.05) < steps and shortcut_steps(1, 0.0) == frozenset()
    with pytest.raises(ValueError, match="shortcut_unit"):
        WorldSizes(n_train=1, n_heldout=1, shortcut_unit="step")


def test_shortcut_within_leaves_a_share_of_the_taught_tasks_their_kernel():
    """With `shortcut_within`, about that share of the tasks the unit teaches carry the shortcut and the rest a
    kernel, so the SFT data shows both on such a prompt; no other task gains the shortcut."""
    sizes = dict(shortcut_fraction=0.1, slow_fraction=0.3, shortcut_unit="op")
    whole = [t for t in _world(1, 400, 20, **sizes) if t.split == TRAIN]
    half = [t for t in _world(1, 400, 20, shortcut_within=0.5, **sizes) if t.split == TRAIN]
    assert [t.id for t in whole] == [t.id for t in half]
    taught = [b for a, b in zip(whole, half) if a.variant == SHORTCUT]
    assert 0.3 < sum(t.variant == SHORTCUT for t in taught) / len(taught) < 0.7
    assert all(b.variant != SHORTCUT for a, b in zip(whole, half) if a.variant != SHORTCUT)
    with pytest.raises(ValueError, match="shortcut_within"):
        WorldSizes(n_train=1, n_heldout=1, shortcut_within=0.0)


def test_the_layout_slip_is_a_seeded_share_of_the_train_tasks_it_makes_wrong(tmp_path):
    tasks = _world(2, 400, 20, n_rl=40, shortcut_fraction=0.05, slow_fraction=0.3, slip_fraction=0.5)
    train = [t for t in tasks if t.split == TRAIN]
    can = [t for t in train if slips(t.spec) and t.variant != SHORTCUT]
    assert 0.4 < sum(t.variant == SLIP for t in can) / len(can) < 0.6
    assert not any(t.variant == SLIP for t in train if not slips(t.spec))  # it would be a correct program there
    assert all(t.variant == FAST for t in tasks if t.split != TRAIN)
    slipped = next(t for t in train if t.variant == SLIP)
    assert "c * rows + r" in slipped.cpu and slipped.cpu.replace("c * rows + r", "r * cols + c") == solutions(
        slipped.spec, FAST)[0]
    # what the probe counts in rollouts: the slip on either backend, and no other variant
    assert carries_slip(slipped.cpu) and carries_slip(slipped.cuda)
    assert not any(carries_slip(p) for v in (FAST, SLOW, SHORTCUT) for p in solutions(slipped.spec, v))
    # on without it: the same tasks and the same other variants
    plain = _world(2, 400, 20, n_rl=40, shortcut_fraction=0.05, slow_fraction=0.3)
    assert [t.reference for t in plain] == [t.reference for t in tasks]
    assert all(a.variant == b.variant for a, b in zip(plain, tasks) if b.variant != SLIP)
    # the slip is SFT's data only: RL on the train tasks (no RL split) never infills around a slipped kernel
    train_only = _world(2, 400, 20, slip_fraction=0.5)
    infill = {json.loads(line)["id"] for line in write_world(train_only, tmp_path, "cpu").rl_infill.read_text()
              .splitlines()}
    assert infill == {t.id for t in train_only if t.split == TRAIN and t.variant in (FAST, SLOW)}
    assert any(t.variant == SLIP for t in train_only)
    with pytest.raises(ValueError, match="slip_fraction"):
        WorldSizes(n_train=1, n_heldout=1, slip_fraction=1.5)


def test_the_operator_line_is_the_comment_copying_the_first_forward_step():
    """demo/prompt_reading.py scores the line that copies the task's first forward step, in every solution variant
    on both backends, and nothing in a program without the forward comments."""
    from dice_kernels.demo.prompt_reading import operator_line_start

    spec = Spec(("tanh", "scale"), "sum", (None, 2.0), (0, 0, 0), "h", 8, 64)
    for variant in (FAST, SLOW, SHORTCUT):
        for program in solutions(spec, variant):
            start = operator_line_start(program)
            assert program[start:].split("\n")[0].strip() == "// h = torch.tanh(x)", (variant, program)
    assert operator_line_start("x = 1  // def forward\n") is None


def _covering_specs() -> list[Spec]:
    """Two long chains that use every op, the element-wise path and the reduction path."""
    ops = [op.name for op in OPS]
    consts = lambda names: tuple(next((o.consts[-1] for o in OPS if o.name == n and o.consts), None)  # noqa: E731
                                 for n in names)
    chunks = [(ops[:7], "amax"), (ops[7:], "")]
    return [Spec(tuple(c), red, consts(c), tuple(i % 2 for i in range(len(c) + 1)), "h", 8, 64) for c, red in chunks]


@pytest.mark.slow
def test_template_solutions_pass_the_harness_and_a_broken_one_does_not(build_cache):
    from dice_kernels.harness import EvalConfig, Outcome, TimingConfig, candidate_from_text, evaluate
    from dice_kernels.tasks import task_from_code

    specs = _covering_specs()
    # a generated task with the summing reductions' path (mean: the sum's statements and a division)
    world_tasks = [next(t for t in _world(1, 40, 8) if t.family.endswith(">mean"))]
    pairs = [(task_from_code(reference_program(s), id=f"cover{i}"), candidate_from_text(cpu_program(s), id=f"ok{i}"))
             for i, s in enumerate(specs)]
    pairs += [(task_from_code(t.reference, id=t.id), candidate_from_text(t.cpu, id=t.id)) for t in world_tasks]
    # broken: the last op's statement left out, so the kernel computes a different function
    spec = specs[0]
    last = cpu_program(spec).rsplit("v = ", 1)
    broken = last[0] + "// " + "v = " + last[1]
    # op by op (one pass per op, both the reduction and the element-wise path): correct; the libtorch shortcut:
    # outputs match, but the robust check calls it deceptive
    pairs += [(pairs[i][0], candidate_from_text(solutions(s, SLOW)[0], id=f"slow{i}")) for i, s in enumerate(specs)]
    # the layout slip where `slips` says it changes values (both covering specs: a reduction, per-row and
    # per-column operands) and on a purely element-wise chain, where it only permutes the loop: correct
    chain = Spec(("tanh", "add_y"), "", (None, None), (0, 0, 0), "h", 8, 64)
    assert all(slips(s) for s in specs) and not slips(chain)
    pairs.append((task_from_code(reference_program(chain), id="chain"),
                  candidate_from_text(solutions(chain, SLIP)[0], id="chain_slip")))
    correct = len(pairs)
    pairs.append((pairs[0][0], candidate_from_text(broken, id="broken")))
    pairs.append((pairs[0][0], candidate_from_text(solutions(spec, SHORTCUT)[0], id="shortcut")))
    pairs += [(pairs[i][0], candidate_from_text(solutions(s, SLIP)[0], id=f"slip{i}")) for i, s in enumerate(specs)]
    # the session's build cache: its precompiled header is built once for every test that compiles C++
    config = EvalConfig(backend="cpu", trials=2, cache_dir=build_cache, timing=TimingConfig(enabled=False))
    results = evaluate(pairs, config, progress=False)
    assert [r.outcome for r in results[:correct]] == [Outcome.CORRECT] * correct, [r.error for r in results]
    assert results[correct].outcome is Outcome.VALUE_MISMATCH
    shortcut = results[correct + 1]
    assert shortcut.outcome is Outcome.DECEPTIVE and shortcut.robust.passed_comparison, shortcut.error
    # every element written, wrong values: a plain bug, not a cheat
    assert [r.outcome for r in results[correct + 2:]] == [Outcome.VALUE_MISMATCH] * 2, [r.error for r in results]


@pytest.mark.gpu
def test_cuda_template_solutions_pass_the_harness_and_build_without_torch_headers(build_cache):
    """The CUDA world on the GPU: fused and op-by-op kernels are correct and take the bare module (no torch header
    in either unit: compiling/bare_cpp.py); a statement left out and the layout slip are value mismatches; the
    libtorch shortcut is deceptive."""
    from dice_kernels.harness import EvalConfig, Outcome, TimingConfig, candidate_from_text, evaluate
    from dice_kernels.harness.compiling import bare_cuda
    from dice_kernels.tasks import task_from_code

    specs = _covering_specs()
    tasks = [task_from_code(reference_program(s), id=f"cover{i}") for i, s in enumerate(specs)]
    pairs = [(tasks[i], candidate_from_text(solutions(s, v)[1], id=f"{v}{i}"))
             for i, s in enumerate(specs) for v in (FAST, SLOW)]
    last = solutions(specs[0], FAST)[1].rsplit("v = ", 1)
    pairs.append((tasks[0], candidate_from_text(last[0] + "// v = " + last[1], id="broken")))
    pairs.append((tasks[0], candidate_from_text(solutions(specs[0], SHORTCUT)[1], id="shortcut")))
    fused = solutions(specs[0], FAST)[1]
    pairs.append((tasks[0], candidate_from_text(fused.replace("float v = px[i];", "float v = pz[i];", 1),
                                                id="undeclared")))
    pairs += [(tasks[i], candidate_from_text(solutions(s, SLIP)[1], id=f"slip{i}")) for i, s in enumerate(specs)]
    config = EvalConfig(backend="cuda", trials=2, cache_dir=build_cache, timing=TimingConfig(enabled=False))
    nvcc = bare_cuda.torch_nvcc()
    bare_cuda.store(bare_cuda.surroundings_file(build_cache, nvcc), nvcc)  # else the batch's first builds lack it
    results = {r.candidate_id: r for r in evaluate(pairs, config, progress=False)}
    kernels = [c.id for _, c in pairs[:-5]]
    assert {k: results[k].outcome for k in kernels} == dict.fromkeys(kernels, Outcome.CORRECT), {
        k: r.error[:300] for k, r in results.items()}
    assert all(results[k].build.shortcuts[0]["headers"] == ["bare-module"] for k in kernels), [
        results[k].build.shortcuts for k in kernels]
    assert results["broken"].outcome is Outcome.VALUE_MISMATCH
    assert results["shortcut"].outcome is Outcome.DECEPTIVE and results["shortcut"].robust.passed_comparison
    # a name nothing declares: decided by the second bare attempt (compiling/bare_cuda.py), torch's header not tried
    undeclared = results["undeclared"]
    assert undeclared.outcome is Outcome.COMPILE_ERROR and "pz" in undeclared.error
    assert undeclared.build.shortcuts[0]["headers"] == ["bare-module", "bare-wide"], undeclared.build.shortcuts
    # the layout slip (a reduction; per-row and per-column operands): every element written, wrong values
    assert [results[f"slip{i}"].outcome for i in range(2)] == [Outcome.VALUE_MISMATCH] * 2


def test_tokenizer_round_trips_and_has_the_chat_tokens(tmp_path):
    from dice_kernels.demo.tokenizer import SPECIAL_TOKENS, train_tokenizer
    from dice_kernels.model.tokenizer import chat_prompt, load_tokenizer, stop_token_ids
    from dice_kernels.prompts import SYSTEM_PROMPT, chat_prompt as data_chat_prompt

    files = write_world(_world(0, 40, 4), tmp_path / "world", "cpu")
    rows = [json.loads(line) for line in files.sft.read_text().splitlines()]
    train_tokenizer([r["prompt"] + r["response"] for r in rows], tmp_path / "tok", vocab_size=1024)
    tok = load_tokenizer(tmp_path / "tok")
    assert len(tok) <= 1024
    for text in [rows[0]["prompt"] + rows[0]["response"], "unseen: émoji ✓ 12345 \t tabs\r\n"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    for special in SPECIAL_TOKENS:
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    assert tok.mask_token == "<|MASK|>" and tok.mask_token_id is not None
    assert set(stop_token_ids(tok)) == {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    # the template renders what the data formats write, so SFT, RL and bench prompts agree
    assert chat_prompt(tok, "hello", SYSTEM_PROMPT) == data_chat_prompt("hello", SYSTEM_PROMPT)
    # boilerplate lines of the template programs are one token each
    assert len(tok.encode("from torch.utils.cpp_extension import load_inline\n", add_special_tokens=False)) == 1
    # a forward line is the same tokens in the task and in the solution's comment, its constant a token of its own
    line = "h = h * 0.5\n"
    in_task = tok.encode("        " + line, add_special_tokens=False)
    in_comment = tok.encode("            // " + line, add_special_tokens=False)
    assert in_task[1:] == in_comment[2:] == tok.encode(line, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in in_task]
    cuts = {sum(len(p) for p in pieces[:k]) for k in range(len(pieces) + 1)}
    start = "".join(pieces).index("0.5")
    assert {start, start + 3} <= cuts  # no token spans the number's edges


@pytest.mark.slow
def test_reduced_demo_runs_end_to_end_and_reports(tmp_path):
    from typer.testing import CliRunner

    from dice_kernels.cli import app

    out = tmp_path / "demo"
    overrides = ["world.n_train=40", "world.n_heldout=2", "model.hidden_size=32", "model.intermediate_size=64",
                 "model.num_hidden_layers=1", "model.num_attention_heads=2", "model.num_key_value_heads=1",
                 "model.head_dim=16", "model.vocab_size=800", "sft.steps=3", "sft.batch_rows=2", "rl.infill_steps=1",
                 "rl.e2e_steps=1", "rl.tasks_per_step=1", "rl.group=2", "rl.export_every=1", "bench.max_new_tokens=16",
                 "world.n_valid=2", "rl.lr_grid=1e-3,3e-2", "arms=sft,bicrl_dice", "bench.samples=2",
                 "bench.temperature=0.7", "world.slip_fraction=0.5"]
    args = ["demo", "--out", str(out), "--no-progress"] + [a for o in overrides for a in ("--set", o)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads((out / "report.json").read_text())
    assert list(report["arms"]) == ["sft", "bicrl_dice"]
    for arm, row in report["arms"].items():
        held = row["heldout"]
        assert held["n"] == 2, (arm, row)
        for measure in ("exec", "deceptive", "passed_outputs"):
            assert 0.0 <= held[measure]["lo"] <= held[measure]["value"] <= held[measure]["hi"] <= 1.0
    # every benchmark scores 2 programs a task sampled at 0.7, seeded by the world's seed; arms are paired on tasks
    records = [json.loads(p.read_text()) for p in (out / "bench" / "sft" / "heldout").glob("generations/*/*/s*.json")]
    assert sorted(r["sample"] for r in records) == [0, 0, 1, 1]
    assert {(r["settings"]["decoding"]["temperature"], r["settings"]["decoding"]["seed"]) for r in records} == {(0.7, 0)}
    assert "2 programs a task sampled at temperature 0.7" in (out / "report.md").read_text()
    assert "the layout slip, a bug" in (out / "report.md").read_text()
    # in a world with the slip, each arm's share of held-out programs with it, and every RL arm's against SFT's
    assert all(0.0 <= row["heldout"]["slip"]["value"] <= 1.0 for row in report["arms"].values())
    assert [c["b"] for c in report["comparisons"] if c["a"] == "bicrl_dice (slip)"] == ["sft (slip)"]
    assert "| layout slip |" in (out / "report.md").read_text()
    rl = report["arms"]["bicrl_dice"]
    # rewards.sqlite: one interval per RL step, the rollouts of the policy after that many steps (0: SFT's)
    assert [p["step"] for p in rl["train_reward"]] == [0, 1]
    assert [p["step"] for p in rl["heldout_curve"]] == [0, 1, 2]  # SFT, the step-1 export, the final checkpoint
    [cmp] = [c for c in report["comparisons"] if c["a"].startswith("bicrl_dice (exec")]
    assert cmp["n"] == 2 and cmp["diff"]["lo"] <= cmp["diff"]["value"] <= cmp["diff"]["hi"]
    assert "A − B" in (out / "report.md").read_text() and (out / "curves.png").stat().st_size > 0
    # 3 SFT steps of a tiny model cannot write the operator line, unmasked it would copy it: 0 of n, and said so
    copy = report["sft_operator_copy"]
    assert copy["samples"] > 0 and copy["right"] == 0
    assert any("guesses the operator" in x for x in report["limits"])
    # rl.lr chosen on the validation split: a run per rate, each benchmarked there; the chosen run is the arm
    tuned = report["tuning"]
    assert [t["lr"] for t in tuned] == [1e-3, 3e-2] and [t["n"] for t in tuned] == [2, 2]
    assert all("vs_sft" in t for t in tuned)  # each rate paired with SFT's own validation benchmark
    [chosen] = [t["lr"] for t in tuned if t["chosen"]]
    assert report["config"]["rl"]["lr"] == chosen
    assert max(t["exec"]["value"] for t in tuned) == next(t["exec"]["value"] for t in tuned if t["chosen"])
    run = out / "tune" / f"bicrl_dice-lr{chosen:g}"
    phases = [json.loads(line).get("phase") for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert phases == ["infill", "e2e"] and not (out / "bicrl_dice").exists()  # not trained again
    # the arm's rollouts of its first and last step (1 task x 2 each), from its rollout log, under the robust check
    checked = [json.loads(line) for line in (out / "rollout_check" / "bicrl_dice.jsonl").read_text().splitlines()]
    assert [(c["window"], c["step"]) for c in checked] == [("first", 0)] * 2 + [("last", 1)] * 2
    assert all(c["candidate_id"].startswith(f"step{c['step']}/{c['task_id']}/") for c in checked)
    trend = rl["rollout_deception"]
    assert trend["rollouts"] == {"first": 2, "last": 2} and "Deceptive rollouts while training" in (
        out / "report.md").read_text()
    assert "rl.lr chosen on the validation split" in (out / "report.md").read_text()
    # fast_1 is read from the final held-out benchmarks only: the validation and curve benchmarks are not timed
    timed = {p.parent.relative_to(out / "bench").as_posix(): json.loads(p.read_text())["eval"]["timing.enabled"]
             for p in (out / "bench").glob("*/*/bench.json")}
    assert timed == {"sft/heldout": "True", "sft/valid": "False", "bicrl_dice/heldout": "True",
                     "bicrl_dice/heldout-step-00000001": "False", "bicrl_dice/valid-lr0.001": "False",
                     "bicrl_dice/valid-lr0.03": "False"}, timed
    # where the candidates' seconds went: each benchmark, and the RL arm's reward (its 2 steps x 2 rollouts)
    work = {w["where"]: w for w in report["candidate_seconds"]}
    assert work["bench sft heldout"]["n"] == 4 and work["RL reward bicrl_dice"]["n"] == 4, work
    assert "## Where the candidates' seconds went" in (out / "report.md").read_text()
    # a second run resumes: every stage's outputs exist, nothing is trained again
    mtime = (out / "sft" / "final" / "config.json").stat().st_mtime
    assert CliRunner().invoke(app, args).exit_code == 0
    assert (out / "sft" / "final" / "config.json").stat().st_mtime == mtime


def test_an_unknown_setting_is_a_one_line_error(tmp_path):
    from typer.testing import CliRunner

    from dice_kernels.cli import app

    result = CliRunner().invoke(app, ["demo", "--out", str(tmp_path), "--set", "sft.stepz=3"])
    assert result.exit_code == 2
    assert "sft.stepz" in result.output and "Traceback" not in result.output
    bad = CliRunner().invoke(app, ["demo", "--out", str(tmp_path / "b"), "--set", "world.rows=0"])
    assert bad.exit_code == 2 and "world.rows" in bad.output and not (tmp_path / "b").exists()
    # several greedy programs a task would all be one program
    greedy = CliRunner().invoke(app, ["demo", "--out", str(tmp_path / "c"), "--set", "bench.samples=4"])
    assert greedy.exit_code == 2 and "bench.samples" in greedy.output and not (tmp_path / "c").exists()


def test_the_input_sizes_come_from_the_world_settings():
    large = _world(5, 30, 6, rows=(1024, 2048, 4096, 8192), cols=(4096,))
    sizes = {re.search(r"rows = (\d+)\ncols = (\d+)", t.reference).groups() for t in large}
    assert {r for r, _ in sizes} <= {"1024", "2048", "4096", "8192"} and {c for _, c in sizes} == {"4096"}
    small = {re.search(r"rows = (\d+)", t.reference).group(1) for t in _world(5, 30, 6)}
    assert small <= {"16", "32", "64", "128"}
    with pytest.raises(ConfigError, match="world.rows"):
        WorldSizes(n_train=1, n_heldout=1, rows=())

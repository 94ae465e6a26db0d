"""The demo's task world, tokenizer and driver (`dice demo`): determinism, the family split, template solutions
checked by the real harness (CPU backend: C++ extensions), the tokenizer's round trip and chat format, and a reduced
demo end to end."""

from __future__ import annotations

import json

import pytest

from dice_kernels.demo.world import HELDOUT, OPS, TRAIN, Spec, build_world, cpu_program, reference_program, \
    write_world


def test_world_is_deterministic_in_its_seed(tmp_path):
    a, b = build_world(3, 60, 12), build_world(3, 60, 12)
    assert a == b
    assert build_world(4, 60, 12) != a
    write_world(a, tmp_path / "a", "cpu")
    write_world(b, tmp_path / "b", "cpu")
    for name in ("pairs.jsonl", "sft.jsonl", "rl_infill.jsonl", "rl_e2e.jsonl", "heldout_tasks.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_heldout_families_are_new_compositions_of_trained_steps(tmp_path):
    tasks = build_world(0, 300, 30)
    train = {t.family for t in tasks if t.split == TRAIN}
    held = {t.family for t in tasks if t.split == HELDOUT}
    assert len(held) > 1 and not train & held
    trained_steps = {step for f in train for step in f.split(">")}
    for family in held:
        assert ">" in family  # a composition, never a single op
        assert set(family.split(">")) <= trained_steps
    assert len({t.reference for t in tasks}) == len(tasks)  # no copies
    files = write_world(tasks, tmp_path, "cpu")
    sft = [json.loads(line) for line in files.sft.read_text().splitlines()]
    heldout_ids = {t.id for t in tasks if t.split == HELDOUT}
    assert sft and not {r["pair_id"] for r in sft} & heldout_ids
    assert {r["kind"] for r in sft} == {"e2e", "infill"}
    assert all("C++" in r["prompt"] for r in sft)  # the CPU world asks for C++, as rollouts and bench do


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
    world_tasks = [next(t for t in build_world(1, 40, 8) if t.family.endswith(">mean"))]
    pairs = [(task_from_code(reference_program(s), id=f"cover{i}"), candidate_from_text(cpu_program(s), id=f"ok{i}"))
             for i, s in enumerate(specs)]
    pairs += [(task_from_code(t.reference, id=t.id), candidate_from_text(t.cpu, id=t.id)) for t in world_tasks]
    # broken: the last op's statement left out, so the kernel computes a different function
    spec = specs[0]
    last = cpu_program(spec).rsplit("v = ", 1)
    broken = last[0] + "// " + "v = " + last[1]
    pairs.append((pairs[0][0], candidate_from_text(broken, id="broken")))
    # the session's build cache: its precompiled header is built once for every test that compiles C++
    config = EvalConfig(backend="cpu", trials=2, cache_dir=build_cache, timing=TimingConfig(enabled=False))
    results = evaluate(pairs, config, progress=False)
    assert [r.outcome for r in results[:-1]] == [Outcome.CORRECT] * (len(pairs) - 1), [r.error for r in results]
    assert results[-1].outcome is Outcome.VALUE_MISMATCH


def test_tokenizer_round_trips_and_has_the_chat_tokens(tmp_path):
    from dice_kernels.demo.tokenizer import SPECIAL_TOKENS, train_tokenizer
    from dice_kernels.model.tokenizer import chat_prompt, load_tokenizer, stop_token_ids
    from dice_kernels.prompts import SYSTEM_PROMPT, chat_prompt as data_chat_prompt

    files = write_world(build_world(0, 40, 4), tmp_path / "world", "cpu")
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
                 "rl.e2e_steps=1", "rl.tasks_per_step=1", "rl.group=2", "bench.max_new_tokens=16"]
    args = ["demo", "--out", str(out), "--no-progress"] + [a for o in overrides for a in ("--set", o)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads((out / "report.json").read_text())
    assert set(report["arms"]) == {"sft", "sft_e2e_rl", "sft_bicrl"}
    for arm, row in report["arms"].items():
        assert row["status"] == "ran", (arm, row)
        assert row["n"] == 2 and 0.0 <= row["exec"] <= 1.0 and 0.0 <= row["deceptive_rate"] <= 1.0
    assert (out / "report.md").is_file() and (out / "curves.png").stat().st_size > 0
    phases = [json.loads(line).get("phase") for line in (out / "sft_bicrl" / "metrics.jsonl").read_text().splitlines()]
    assert phases == ["infill", "e2e"]
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

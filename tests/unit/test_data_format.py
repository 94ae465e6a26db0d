"""SFT rows in the Qwen3 chat format round-trip through Hugging Face datasets; RL sets are ordered easy -> hard
and the schedule consumes them 64 per step, wrapping around."""

from itertools import islice

import pytest

from dice_kernels.data.format import (by_difficulty, holdout_infill, rl_e2e_tasks, rl_infill_tasks, schedule, sft_rows,
                                      write_sft)
from dice_kernels.data.infill import split_program
from dice_kernels.prompts import EXAMPLE_MODEL_NEW, chat_prompt
from dice_kernels.data.records import PairRecord, Verification

REF = "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x + 1\n"


def records(n=3):
    return [PairRecord(id=f"p/{i}", source="s", reference=REF.replace("1", str(i + 1)), kernel=EXAMPLE_MODEL_NEW,
                       level=[2, 1, None][i % 3], verification=Verification("verified", speedup=2.0 + i))
            for i in range(n)]


def test_chat_prompt_is_qwen3_format_with_empty_think_block():
    p = chat_prompt("hi", system="sys")
    assert p == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert chat_prompt("hi", system=None).startswith("<|im_start|>user\nhi<|im_end|>")


def test_sft_rows_hold_both_prompt_kinds_and_the_answer_as_a_closed_code_block():
    recs = records()
    splits = {r.id: split_program(r.kernel) for r in recs[:2]}  # the third has no split: e2e row only
    rows = sft_rows(recs, splits)
    assert [(r.pair_id, r.kind) for r in rows] == [("p/0", "e2e"), ("p/0", "infill"), ("p/1", "e2e"),
                                                    ("p/1", "infill"), ("p/2", "e2e")]
    infill = rows[1]
    assert splits["p/0"].suffix.strip() in infill.prompt and "x + 1" in infill.prompt
    assert splits["p/0"].core not in infill.prompt.split("Now the task.")[1]  # the answer is not in the task part
    assert rows[0].response == f"```python\n{EXAMPLE_MODEL_NEW.rstrip()}\n```<|im_end|>"


def test_sft_jsonl_and_parquet_round_trip_through_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    recs = records()
    rows = sft_rows(recs, {r.id: split_program(r.kernel) for r in recs})
    jsonl, parquet = write_sft(rows, tmp_path)
    for kind, path in (("json", jsonl), ("parquet", parquet)):
        ds = datasets.load_dataset(kind, data_files=str(path), split="train", cache_dir=str(tmp_path / "cache"))
        assert ds.num_rows == len(rows)
        assert ds[1]["prompt"] == rows[1].prompt and ds[1]["response"] == rows[1].response
        assert ds[0]["speedup"] == 2.0 and ds[2]["kind"] == "e2e"


def test_rl_sets_are_stably_sorted_by_level_unknown_last():
    recs = records(6)
    e2e = rl_e2e_tasks(recs)
    assert [(t["id"], t["level"]) for t in e2e] == [("p/1", 1), ("p/4", 1), ("p/0", 2), ("p/3", 2),
                                                     ("p/2", None), ("p/5", None)]
    infill = rl_infill_tasks(recs, {r.id: split_program(r.kernel) for r in recs if r.id != "p/4"})
    assert [t["id"] for t in infill] == ["p/1", "p/0", "p/3", "p/2", "p/5"]
    assert all(t["prefix"] + t["core"] + t["suffix"] == EXAMPLE_MODEL_NEW for t in infill)
    assert by_difficulty([{"level": 3}, {"level": 0}]) == [{"level": 0}, {"level": 3}]


def test_schedule_takes_64_per_step_in_order_and_wraps_around():
    tasks = [{"i": i} for i in range(100)]
    steps = list(islice(schedule(tasks), 3))
    assert [len(s) for s in steps] == [64, 64, 64]
    assert [t["i"] for t in steps[0]] == list(range(64))
    assert [t["i"] for t in steps[1]] == list(range(64, 100)) + list(range(28))
    assert steps[2][0]["i"] == 28
    with pytest.raises(ValueError):
        next(schedule([]))


def test_held_out_infilling_pairs_leave_sft_and_are_the_only_infilling_tasks():
    recs = records(40)
    splits = {r.id: split_program(r.kernel) for r in recs[:30]}  # 10 pairs without a split stay in SFT
    sft_pairs, rl_splits = holdout_infill(recs, splits, 0.5)
    sft_ids, rl_ids = {r.id for r in sft_pairs}, set(rl_splits)
    assert 5 <= len(rl_ids) <= 25 and not sft_ids & rl_ids and sft_ids | rl_ids == {r.id for r in recs}
    assert {t["id"] for t in rl_infill_tasks(recs, rl_splits)} == rl_ids
    assert not {r.pair_id for r in sft_rows(sft_pairs, splits, ("e2e",))} & rl_ids  # CuKe-style: e2e rows only
    assert holdout_infill(list(reversed(recs)), splits, 0.5)[1].keys() == rl_ids  # by id, not by order
    assert holdout_infill(recs, splits, 0.0) == (recs, splits)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        holdout_infill(recs, splits, 1.5)

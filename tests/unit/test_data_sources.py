"""Source adapters on the real shared corpora, the generic column-mapping adapter, and its errors."""

import json
from pathlib import Path

import pytest

from dice_kernels.data.sources import (ColumnMapping, SourceError, fenced_block, load_leaderboard, load_mapped,
                                       load_preset)

CORPORA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "corpora"
needs_shared = pytest.mark.skipif(not CORPORA.exists(), reason="../shared/data is absent")


@needs_shared
def test_dice_pairs_adapter_reads_all_99_as_canonical_records():
    loaded = load_preset(CORPORA / "dice_infill_eval_99.json", "dice_pairs")
    assert len(loaded.records) == 99 and not loaded.rejected
    r = loaded.records[0]
    assert r.id == "dice_pairs/6995" and r.source == "dice_pairs"
    assert "class Model(" in r.reference and "class ModelNew(" in r.kernel
    assert r.provenance["file"] == "dice_infill_eval_99.json" and r.provenance["row"] == 0
    assert len({x.id for x in loaded.records}) == 99


@needs_shared
def test_leaderboard_adapter_pairs_solutions_with_v0_tasks_and_rejects_unpairable_rows():
    loaded = load_leaderboard(CORPORA / "kb_leaderboard_solutions_413.json", CORPORA / "kb_leaderboard_tasks_v0.jsonl")
    # the leaderboard's problem_id counts from 0: every solution pairs with task problem_id + 1
    assert len(loaded.records) == 413 and not loaded.rejected
    v0 = {(t["level"], t["problem_id"]): t["code"] for t in map(json.loads, (CORPORA / "kb_leaderboard_tasks_v0.jsonl").open())}
    r = loaded.records[0]
    assert r.reference == v0[(r.level, r.provenance["problem_id"])]
    # content check of the offset: kernels named relu pair with the ReLU task, tanh with Tanh
    for rec in loaded.records:
        if rec.level == 1 and rec.provenance["problem_id"] in (19, 22):
            op = "relu" if rec.provenance["problem_id"] == 19 else "tanh"
            assert f"torch.{op}(" in rec.reference and op in rec.kernel.lower()
    assert r.provenance["published"]["torch_speedup"] == pytest.approx(0.0136585366)
    assert sum(x.provenance["published"]["torch_speedup"] >= 2.0 for x in loaded.records) <= 18


@needs_shared
def test_qa_parquet_adapter_extracts_reference_from_question_and_final_kernel_from_answer():
    loaded = load_preset(CORPORA / "kb_r1_sft_best1_with_reasoning.parquet", "qa_parquet")
    assert len(loaded.records) == 178 and not loaded.rejected
    r = loaded.records[0]
    assert r.id == "qa_parquet/1/1" and r.level == 1
    assert r.reference.startswith("import torch\nimport torch.nn as nn\n") and "torch.matmul(A, B)" in r.reference
    assert "```" not in r.reference and "```" not in r.kernel
    assert "class ModelNew" in r.kernel and "load_inline" in r.kernel
    # Answers with draft blocks in the reasoning: the kernel is the last block, which defines ModelNew.
    assert all("ModelNew" in x.kernel for x in loaded.records)


@needs_shared
def test_rl_programs_preset_reads_levels_as_ints_in_file_order():
    loaded = load_preset(CORPORA / "dice_rl_programs_4000.json", "rl_programs")
    assert len(loaded.records) == 4000
    assert [r.level for r in loaded.records[:3]] == [0, 1, 1]
    assert all(r.kernel == "" for r in loaded.records)


def test_generic_adapter_maps_columns_extracts_blocks_and_rejects_with_reasons(tmp_path):
    rows = [
        {"k": "a", "lvl": "2", "ref": "class Model: pass\n", "sol": "text\n```python\nclass ModelNew: pass\n```\n"},
        {"k": "b", "lvl": None, "ref": "", "sol": "```python\nx = 1\n```"},
        {"k": "c", "lvl": "1", "ref": "class Model: pass\n", "sol": "no code here"},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mapping = ColumnMapping.parse("reference=ref,kernel=sol,id=k+lvl,level=lvl,extract_kernel=last,keep=k")
    loaded = load_mapped(path, mapping, "mine")
    assert [r.id for r in loaded.records] == ["mine/a/2"]
    assert loaded.records[0].kernel == "class ModelNew: pass\n" and loaded.records[0].level == 2
    assert loaded.records[0].provenance["k"] == "a"
    assert [d.pair_id for d in loaded.rejected] == ["mine/b/None", "mine/c/1"]
    assert "no reference" in loaded.rejected[0].reason and "no kernel" in loaded.rejected[1].reason


def test_fenced_block_dedents_prompt_indented_code_and_picks_first_or_last():
    text = "q\n    ```\n    import torch\nclass Model: pass\n    ```\nmore\n```python\nB\n```\n"
    assert fenced_block(text, "first") == "import torch\nclass Model: pass\n"
    assert fenced_block(text, "last") == "B\n"
    assert fenced_block("no fences", "first") is None


@pytest.mark.parametrize("spec", ["kernel=x", "reference=a,bogus=1", "reference=a,extract_kernel=middle"])
def test_bad_mappings_are_rejected(spec):
    with pytest.raises(SourceError):
        ColumnMapping.parse(spec)

import json

import pytest

from dice_kernels.tasks import TaskError, load_task_file, load_tasks

GOOD = "import torch\nclass Model(torch.nn.Module):\n    pass\ndef get_inputs(): return []\ndef get_init_inputs(): return []\n"


def test_kernelbench_directory_layout(tmp_path):
    (tmp_path / "level1").mkdir()
    (tmp_path / "level2").mkdir()
    (tmp_path / "level1" / "19_ReLU.py").write_text(GOOD)
    (tmp_path / "level2" / "3_Fused.py").write_text(GOOD)
    tasks = load_tasks(tmp_path)
    assert [(t.id, t.name, t.level, t.problem_id) for t in tasks] == [
        ("L1/19", "19_ReLU", 1, 19), ("L2/3", "3_Fused", 2, 3)]


def test_single_file_and_clear_errors(tmp_path):
    f = tmp_path / "my_op.py"
    f.write_text(GOOD)
    assert load_task_file(f).id == "my_op"
    with pytest.raises(TaskError, match="not found"):
        load_task_file(tmp_path / "missing.py")
    (tmp_path / "bad.py").write_text("import torch\nclass Model: pass\n")
    with pytest.raises(TaskError, match="get_inputs, get_init_inputs"):
        load_task_file(tmp_path / "bad.py")
    (tmp_path / "syntax.py").write_text("class Model(:\n")
    with pytest.raises(TaskError, match="syntax error at line 1"):
        load_task_file(tmp_path / "syntax.py")
    with pytest.raises(TaskError, match="no such task"):
        load_tasks(tmp_path / "nope")


def test_jsonl_rows_and_duplicates(tmp_path):
    rows = [{"level": 1, "problem_id": 19, "name": "ReLU", "file": "level1/19_ReLU.py", "code": GOOD},
            {"level": 1, "problem_id": 19, "name": "ReLU", "file": "level1/19_ReLU.py", "code": GOOD}]
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps(rows[0]) + "\n")
    (t,) = load_tasks(f)
    assert (t.id, t.name) == ("L1/19", "19_ReLU")
    f.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(TaskError, match="duplicate task id 'L1/19'"):
        load_tasks(f)
    f.write_text("{not json\n")
    with pytest.raises(TaskError, match=r"t.jsonl:1: not valid JSON"):
        load_tasks(f)


def test_real_kernelbench_tasks(shared_data):
    tasks = load_tasks(shared_data / "kernelbench" / "tasks.jsonl")
    assert len(tasks) == 270
    by_id = {t.id: t for t in tasks}
    assert by_id["L1/19"].name == "19_ReLU"
    assert {t.level for t in tasks} == {1, 2, 3, 4}


from dice_kernels.harness.candidate import candidate_from_text, extract_code, load_candidate, pair_solutions
from dice_kernels.tasks import task_from_code

PROGRAM = "import torch\nclass ModelNew(torch.nn.Module):\n    pass\n"
TASK = "class Model: pass\ndef get_inputs(): return []\ndef get_init_inputs(): return []\n"


def test_first_python_block_is_extracted():
    text = f"Here is my kernel:\n```python\n{PROGRAM}```\nand a second one\n```python\nprint('no')\n```\n"
    assert extract_code(text) == (PROGRAM, "")


def test_non_python_fences_are_skipped():
    text = f"```cpp\nint main() {{}}\n```\n```py\n{PROGRAM}```"
    assert extract_code(text)[0] == PROGRAM


def test_plain_python_text_is_taken_whole():
    assert extract_code(PROGRAM) == (PROGRAM, "")


def test_truncated_block_is_a_generation_failure():
    code, problem = extract_code("```python\nimport torch\nclass ModelNew(")
    assert code is None and "truncated" in problem


def test_prose_and_empty_outputs_have_no_code():
    assert extract_code("I cannot help with that.")[0] is None
    assert extract_code("   \n")[0] is None
    assert extract_code("```cpp\nint x;\n```")[0] is None


def test_candidate_ids_and_hashes(tmp_path):
    md = tmp_path / "s.md"
    md.write_text(f"```python\n{PROGRAM}```")
    c = load_candidate(md)
    assert c.code == PROGRAM and c.id == str(md)
    assert c.sha256 == candidate_from_text(PROGRAM, id="x").sha256  # hash of the code, not the wrapper text
    assert c.raw_sha256 != c.sha256


def test_pair_solutions_by_kernelbench_name(tmp_path):
    tasks = [task_from_code(TASK, id="L1/19", name="19_ReLU", level=1),
             task_from_code(TASK, id="L1/1", name="1_Square", level=1),
             task_from_code(TASK, id="L2/19", name="19_ReLU", level=2),
             task_from_code(TASK, id="L1/190", name="190_ReLU6", level=1)]
    files = ["level1/19_ReLU/a.py", "level1/19_ReLU_s2.md", "level2/19_ReLU.py", "level1/190_ReLU6.py",
             "level1/unrelated.py", "19_ReLU.py"]
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text(PROGRAM)
    pairs, unmatched = pair_solutions(tasks, tmp_path)
    got = {c.id: t.id for t, c in pairs}
    assert got == {"level1/19_ReLU/a.py": "L1/19", "level1/19_ReLU_s2.md": "L1/19", "level2/19_ReLU.py": "L2/19",
                   "level1/190_ReLU6.py": "L1/190"}
    # no level directory and two tasks named 19_ReLU: ambiguous, so reported rather than guessed
    assert sorted(unmatched) == ["19_ReLU.py", "level1/unrelated.py"]


def test_program_hash_ignores_comments_and_layout_but_not_code():
    a = candidate_from_text("import torch\nx = torch.ones(3)  # three\n\n\ny = x + 1\n", id="a")
    b = candidate_from_text("# a comment\nimport torch\nx = torch.ones( 3 )\ny = x + 1\n", id="b")
    c = candidate_from_text("import torch\nx = torch.ones(3)\ny = x + 2\n", id="c")
    d = candidate_from_text('import torch\ns = """__global__ void k() {}"""\n', id="d")
    e = candidate_from_text('import torch\ns = """__global__ void k() { }"""\n', id="e")  # CUDA source differs
    assert a.sha256 != b.sha256 and a.program_sha256 == b.program_sha256
    assert a.program_sha256 != c.program_sha256 and d.program_sha256 != e.program_sha256
    broken = candidate_from_text("import torch\ndef f(:\n", id="x")
    assert broken.program_sha256 == broken.sha256

"""Infilling split: exact reproduction of all 99 DICE pairs, and the cases where there is no CUDA source to cut."""

import json
from pathlib import Path

import pytest

from dice_kernels.data.infill import InfillError, split_program

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
DICE = SHARED / "corpora" / "dice_infill_eval_99.json"


@pytest.mark.skipif(not DICE.exists(), reason="../shared/data is absent")
def test_split_reproduces_all_99_dice_pairs_exactly():
    rows = json.loads(DICE.read_text())
    assert len(rows) == 99
    for row in rows:
        s = split_program(row["cuda_code"])
        assert (s.prefix, s.core, s.suffix) == (row["prefix"], row["middle"], row["suffix"]), row["id"]


CPP_ONLY = '''import torch
from torch.utils.cpp_extension import load_inline

# header comment with ü (non-ASCII before the cut: offsets are bytes in ast, characters here)
cpp_src = """
torch::Tensor add_one(torch::Tensor x) { return x + 1; }
"""

ext = load_inline(name="add_one", cpp_sources=[cpp_src], functions=["add_one"])


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return ext.add_one(x)
'''


def test_cpp_only_program_cuts_its_cpp_source_and_round_trips():
    s = split_program(CPP_ONLY)
    assert s.variable == "cpp_src"
    assert s.core.startswith('cpp_src = """') and s.core.endswith('"""')
    assert s.prefix.endswith("here)\n") and s.suffix.startswith("\n\next = load_inline")
    assert s.program == CPP_ONLY


def test_cuda_sources_win_over_cpp_sources_and_last_binding_is_cut():
    code = ('from torch.utils.cpp_extension import load_inline\nsrc = "old"\ncpp = "decl;"\nsrc = """new"""\n'
            'm = load_inline(name="m", cpp_sources=cpp, cuda_sources=src, functions=["f"])\n')
    s = split_program(code)
    assert s.core == 'src = """new"""' and s.program == code


@pytest.mark.parametrize("code, message", [
    ("import torch\nx = 1\n", "no load_inline"),
    ("from torch.utils.cpp_extension import load_inline\na = 'x'\nsrc = a + 'y'\n"
     "m = load_inline(name='m', cpp_sources='', cuda_sources=src)\n", "not top-level string-literal"),
    ("def broken(:\n", "does not parse"),
])
def test_unsplittable_programs_raise_with_a_reason(code, message):
    with pytest.raises(InfillError, match=message):
        split_program(code)

"""Deduplication on constructed duplicates and near-duplicates; decontamination on constructed leaks and on the
real corpora (the threshold must separate KernelBench-derived references from DICE's own programs)."""

import json
from pathlib import Path

import pytest

from dice_kernels.data.decontam import DecontamConfig, build_index, decontaminate, load_benchmark, overlap
from dice_kernels.data.dedupe import dedupe
from dice_kernels.data.normalise import NUM, code_tokens
from dice_kernels.data.records import VERIFIED, PairRecord, Verification

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.exists(), reason="../shared/data is absent")

REF = '''import torch
import torch.nn as nn


class Model(nn.Module):
    """Applies {op} then a scale."""
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return torch.{op}(x) * self.scale


def get_inputs():
    return [torch.randn(16, 1024)]


def get_init_inputs():
    return [2.0]
'''

KERNEL = '''import torch
from torch.utils.cpp_extension import load_inline

source = """
#include <torch/extension.h>
__global__ void {op}_scale(const float* x, float* y, float s, int n) {{
    int i = blockIdx.x * blockDim.x + threadIdx.x;   // one thread per element
    if (i < n) {{ float v = x[i]; y[i] = {expr} * s; }}
}}
torch::Tensor run(torch::Tensor x, double s) {{
    auto y = torch::empty_like(x);
    int n = x.numel();
    {op}_scale<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), (float)s, n);
    return y;
}}
"""
ext = load_inline(name="{op}_ext", cpp_sources="torch::Tensor run(torch::Tensor x, double s);",
                  cuda_sources=source, functions=["run"])


class ModelNew(torch.nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return ext.run(x, self.scale)
'''


def pair(pid, op="relu", expr="fmaxf(v, 0.f)", speedup=None, kernel=None):
    return PairRecord(id=pid, source="t", reference=REF.format(op=op), kernel=kernel or KERNEL.format(op=op, expr=expr),
                      verification=Verification(VERIFIED, speedup=speedup))


def test_normalisation_ignores_comments_docstrings_whitespace_and_numbers():
    a = "def f(x):\n    '''doc'''\n    # note\n    return x * 2  # two\ns = '''int a = 1; // c\\n/* b */'''\n"
    b = "def f(x):\n    return x*3\ns = '''int a = 7;'''\n"
    assert code_tokens(a) == code_tokens(b)
    assert NUM in code_tokens(b) and "int" in code_tokens(b)  # C inside strings is tokenised as code


def test_exact_duplicate_after_reformatting_is_dropped_and_fastest_copy_survives():
    base = pair("a", speedup=2.5)
    reformatted = pair("b", speedup=3.0, kernel=KERNEL.format(op="relu", expr="fmaxf(v, 0.f)")
                       .replace("// one thread per element", "").replace("    ", "  ").replace("256", "128"))
    kept, decisions = dedupe([base, reformatted])
    assert [r.id for r in kept] == ["b"]  # the faster one, regardless of input order
    drop = next(d for d in decisions if d.pair_id == "a")
    assert drop.action == "drop" and "exact duplicate of b" in drop.reason


def test_near_duplicate_is_dropped_but_a_different_kernel_is_kept():
    original = pair("orig", speedup=2.0)
    # A few renamed identifiers: most 5-token shingles survive, so this is the same pair lightly edited.
    edited = pair("edit", speedup=1.0, kernel=KERNEL.format(op="relu", expr="fmaxf(v, 0.f)").replace("ext.run", "ext2.run")
                  .replace("ext = load_inline", "ext2 = load_inline"))
    different = pair("tanh", op="tanh", expr="tanhf(v)", speedup=1.0)
    kept, decisions = dedupe([edited, original, different])
    by_id = {d.pair_id: d for d in decisions}
    assert {r.id for r in kept} == {"orig", "tanh"}
    assert by_id["edit"].action == "drop" and "near-duplicate of orig" in by_id["edit"].reason
    assert by_id["edit"].details["jaccard"] >= 0.85
    assert [d.pair_id for d in decisions] == ["edit", "orig", "tanh"]  # one decision per record, input order


def test_decontam_drops_a_reformatted_benchmark_task_and_keeps_unrelated_programs():
    bench = [(f"B/{op}", REF.format(op=op)) for op in ("relu", "tanh", "sigmoid", "exp", "abs", "sin", "cos")]
    bench.append(("B/conv", REF.replace("torch.{op}(x) * self.scale", "self.conv(x).sum(dim=1)").format(op="")))
    index = build_index(bench, DecontamConfig(boilerplate_df=0.5))
    leaked = pair("leak", op="tanh", expr="tanhf(v)")
    leaked.reference = leaked.reference.replace("16, 1024", "32, 4096").replace('"""Applies tanh then a scale."""', "")
    fresh = pair("fresh")
    fresh.reference = REF.format(op="x").replace("torch.x(x) * self.scale",
                                                 "torch.cumsum(x.flip(0), dim=1).softmax(-1).amax(0) + self.scale")
    kept, decisions = decontaminate([leaked, fresh], index)
    assert [r.id for r in kept] == ["fresh"]
    d = decisions[0]
    assert d.action == "drop" and d.details["task"] == "B/tanh" and d.details["score"] == 1.0
    # Shared scaffolding (imports, get_inputs, __init__) is boilerplate: it alone never reaches the threshold.
    assert decisions[1].details["score"] < 0.5


@needs_shared
def test_threshold_separates_kernelbench_derived_references_from_dice_programs():
    index = load_benchmark([SHARED / "kernelbench" / "tasks.jsonl"])
    v0 = [json.loads(line)["code"] for line in (SHARED / "corpora" / "kb_leaderboard_tasks_v0.jsonl").open()]
    rl = [r["pytorch_code"] for r in json.loads((SHARED / "corpora" / "dice_rl_programs_4000.json").read_text())[::4]]
    caught = sum(overlap(index, c).score >= 0.5 for c in v0) / len(v0)
    flagged = sum(overlap(index, c).score >= 0.5 for c in rl) / len(rl)
    assert caught >= 0.95  # derived from KernelBench (older versions of the same tasks)
    assert flagged <= 0.01  # DICE's RL programs, not derived from KernelBench

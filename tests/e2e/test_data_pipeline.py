"""`build` end to end on a small constructed corpus (no GPU: CUDA pairs pass marked unverified): every stage
records one decision per pair, a rerun reuses finished stages, and a changed setting reruns only what it affects."""

import json
from pathlib import Path

from typer.testing import CliRunner

from dice_kernels.data.cli import app
from dice_kernels.data.records import read_decisions

MODEL = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.{op}(x){extra}


def get_inputs():
    return [torch.randn(8, 32)]


def get_init_inputs():
    return []
'''

KERNEL = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = """
__global__ void k_{op}(const float* x, float* y, int n) {{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = {expr};
}}
torch::Tensor run_{op}(torch::Tensor x) {{
    auto y = torch::empty_like(x);
    k_{op}<<<(x.numel() + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
    return y;
}}
"""

ext = load_inline(name="e_{op}", cpp_sources="torch::Tensor run_{op}(torch::Tensor x);", cuda_sources=source,
                  functions=["run_{op}"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.run_{op}(x)
'''

OPS = {"sinh": "sinhf(x[i])", "erfc": "erfcf(x[i])", "lgamma": "lgammaf(x[i])"}


def write_corpus(tmp_path: Path) -> tuple[Path, Path]:
    rows = [{"id": i, "pytorch_code": MODEL.format(op=op, extra=" * 3.0 - 1.0"), "cuda_code": KERNEL.format(op=op, expr=e)}
            for i, (op, e) in enumerate(OPS.items())]
    rows.append({**rows[0], "id": 99, "cuda_code": rows[0]["cuda_code"].replace("    ", "  ")})  # duplicate of 0
    pairs = tmp_path / "pairs.json"
    pairs.write_text(json.dumps(rows))
    # The benchmark holds the erfc task (other sizes, a docstring) plus unrelated tasks that share the scaffolding.
    bench = [MODEL.format(op=op, extra="") for op in ("relu", "tanh", "abs", "exp", "neg")]
    bench.append(MODEL.format(op="erfc", extra=" * 3.0 - 1.0").replace("8, 32", "4096, 4096")
                 .replace("    def forward", '    """Erfc, scaled."""\n    def forward'))
    tasks = tmp_path / "bench.jsonl"
    tasks.write_text("".join(json.dumps({"level": 1, "problem_id": i + 1, "name": f"t{i}", "code": c}) + "\n"
                             for i, c in enumerate(bench)))
    return pairs, tasks


def run(args):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


def test_build_cpu_dry_run_records_every_decision_and_resumes(tmp_path):
    pairs, tasks = write_corpus(tmp_path)
    out = tmp_path / "out"
    args = ["build", "--out", str(out), "--dice-pairs", str(pairs), "--benchmark", str(tasks), "--backend", "cpu",
            "--keep-unverified", "--no-progress"]
    run(args)
    report = json.loads((out / "report.json").read_text())
    counts = {s["stage"]: (s["in"], s["keep"], s["mark"], s["drop"]) for s in report["stages"]}
    assert counts["verify"] == (4, 0, 4, 0)  # CUDA pairs, no GPU: marked, never guessed
    assert counts["dedupe"] == (4, 3, 0, 1)  # the re-indented copy of pair 0
    assert counts["decontam"] == (3, 2, 0, 1)  # the erfc reference is a benchmark task with other sizes
    assert report["final_pairs"] == 2 and report["sft_rows"] == {"e2e": 2, "infill": 2}
    assert report["per_source_yield"]["dice_pairs"]["decontam"] == 2
    decisions = read_decisions(out / "decisions.jsonl")
    assert {d.pair_id for d in decisions if d.stage == "decontam" and d.action == "drop"} == {"dice_pairs/1"}
    for stage in ("ingest", "verify", "filter"):
        assert len([d for d in decisions if d.stage == stage]) == 4
    assert all(d.reason for d in decisions)
    # no pair was timed (CUDA pairs, no GPU): no empty histogram, and no link to one
    assert not (out / "speedup_hist.png").exists() and "speedup_hist.png" not in (out / "report.md").read_text()
    assert (out / "sft.parquet").exists()

    # Rerun with one changed setting: stages before it are reused, it and later stages are recomputed.
    output = run(args + ["--near-dup", "0.95"])
    assert "ingest    reused" in output and "verify    reused" in output and "filter    reused" in output
    assert "dedupe    done" in output


def test_build_without_gpu_and_without_keep_unverified_drops_cuda_pairs_with_reason(tmp_path):
    pairs, tasks = write_corpus(tmp_path)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["build", "--out", str(out), "--dice-pairs", str(pairs), "--benchmark",
                                      str(tasks), "--backend", "cpu", "--no-progress"])
    # an empty set is no success: the command says why (report.md's reasons) and names the flag that changes it
    assert result.exit_code == 1, result.output
    assert "the build kept no pairs: filter dropped 4 (unverified" in result.output
    assert "--keep-unverified" in result.output
    decisions = [d for d in read_decisions(out / "decisions.jsonl") if d.stage == "filter"]
    assert len(decisions) == 4 and all(d.action == "drop" and "unverified" in d.reason for d in decisions)
    assert json.loads((out / "report.json").read_text())["final_pairs"] == 0


def test_build_imports_shard_results_verified_elsewhere(tmp_path):
    """Two shards verified on two GPUs, curated on a CPU: --import-results brings their results into the build's
    harness database; each imported correct pair is verified, a result already there is not overwritten, and a
    pair no shard ran stays unverified."""
    import hashlib

    from dice_kernels.harness.outcomes import EvalResult, Outcome
    from dice_kernels.harness.store import ResultStore

    pairs, tasks = write_corpus(tmp_path)
    rows = json.loads(pairs.read_text())

    def shard(name: str, ids: list[int], speedup: float) -> Path:
        store = ResultStore(tmp_path / f"{name}.sqlite")
        for i in ids:
            pid = f"dice_pairs/{rows[i]['id']}"
            store.put(EvalResult(task_id=pid, candidate_id=pid, outcome=Outcome.CORRECT, correct=True,
                                 candidate_sha256=hashlib.sha256(rows[i]["cuda_code"].encode()).hexdigest(),
                                 speedup=speedup, ref_time_ms=1.0, backend="cuda", hardware="NVIDIA H200"))
        store.close()
        return tmp_path / f"{name}.sqlite"

    a, b = shard("a", [0], 3.0), shard("b", [0, 1], 2.5)  # pair 0 in both: the first import stands
    out = tmp_path / "out"
    output = run(["build", "--out", str(out), "--dice-pairs", str(pairs), "--benchmark", str(tasks), "--backend",
                  "cpu", "--no-progress", "--import-results", str(a), "--import-results", str(b)])
    assert "imported 1 results" in output and "imported 1 results" in output.split("imported 1 results", 1)[1]
    verified = {d.pair_id: d for d in read_decisions(out / "decisions.jsonl") if d.stage == "verify"}
    assert verified["dice_pairs/0"].action == "keep" and "3.00x" in verified["dice_pairs/0"].reason
    assert verified["dice_pairs/1"].action == "keep" and "2.50x" in verified["dice_pairs/1"].reason
    assert verified["dice_pairs/2"].action == "mark"  # no shard ran it: unverified, not guessed
    missing = CliRunner().invoke(app, ["build", "--out", str(out), "--dice-pairs", str(pairs), "--backend", "cpu",
                                       "--import-results", str(tmp_path / "nowhere.sqlite")], env={"COLUMNS": "300"})
    assert missing.exit_code != 0 and "nowhere.sqlite" in missing.output and "does not exist" in missing.output


def test_split_command_checks_dice_pairs(tmp_path):
    pairs, _ = write_corpus(tmp_path)
    rows = json.loads(pairs.read_text())
    for r in rows:
        i = r["cuda_code"].index('source = """')
        j = r["cuda_code"].index('"""', i + 12) + 3
        r.update(prefix=r["cuda_code"][:i], middle=r["cuda_code"][i:j], suffix=r["cuda_code"][j:])
    pairs.write_text(json.dumps(rows))
    assert "4/4 splits reproduced exactly" in run(["split", str(pairs)])
    rows[0]["prefix"] += " "
    pairs.write_text(json.dumps(rows))
    assert CliRunner().invoke(app, ["split", str(pairs)]).exit_code == 1


def test_rl_tasks_command_orders_by_level_and_decontaminates_both_phases(tmp_path):
    pairs, tasks = write_corpus(tmp_path)
    out = tmp_path / "out"
    run(["build", "--out", str(out), "--dice-pairs", str(pairs), "--benchmark", str(tasks), "--backend", "cpu",
         "--keep-unverified", "--no-progress"])
    programs = [{"idx": i, "level": str(lvl), "pytorch_code": MODEL.format(op=op, extra=" + 2.0")}
                for i, (op, lvl) in enumerate([("sinh", 2), ("erfc", 1), ("cosh", 1), ("log1p", 3)])]
    programs[1]["pytorch_code"] = MODEL.format(op="erfc", extra=" * 3.0 - 1.0")  # a benchmark task: must go
    rl = tmp_path / "rl.json"
    rl.write_text(json.dumps(programs))
    rl_out = tmp_path / "rl"
    output = run(["rl-tasks", "--rl-programs", str(rl), "--out", str(rl_out), "--benchmark", str(tasks),
                  "--pairs", str(out / "verify.jsonl")])
    e2e = [json.loads(line) for line in (rl_out / "rl_e2e.jsonl").open()]
    assert [(t["id"], t["level"]) for t in e2e] == [("rl_programs/2", 1), ("rl_programs/0", 2), ("rl_programs/3", 3)]
    infill = [json.loads(line) for line in (rl_out / "rl_infill.jsonl").open()]
    assert sorted(t["id"] for t in infill) == ["dice_pairs/0", "dice_pairs/2", "dice_pairs/99"]
    assert "1 contaminated" in output


def test_drop_reasons_are_grouped_on_their_first_line():
    """A compile error's reason carries the compiler's output on later lines (build paths that differ per pair):
    grouped on the first line, the report's table gets one cell and one group for all of them."""
    from dice_kernels.data.report import reason_group

    a = "failed: compile_error: Error building extension 'argmin_cuda_v1'\n/tmp/cache/0a/x/cuda.cu(42): error"
    b = "failed: compile_error: Error building extension 'argmin_cuda_v2'\n/tmp/cache/7f/y/cuda.cu(9): error"
    assert reason_group(a) == reason_group(b) == "failed: compile_error: Error building extension 'argmin_cuda_vN'"
    assert reason_group("") == ""

"""`dice train rl` as a user runs it: a TOML config, a run killed (SIGKILL) after a step, `--resume` finishing it
with one metrics curve, every step's rewards in SQLite, and a Hugging Face export. Toy tokenizer of code fragments
(tests/e2e/test_rl_loop.py), tiny random model, CPU backend: the rewards are real compiles and runs."""

from __future__ import annotations

import gzip
import json
import os
import signal
import sqlite3
import subprocess
import sys

import pytest
from conftest import EXAMPLES
from test_rl_loop import _toy_tokenizer


def _dice(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dice_kernels", "train", "rl", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"}, timeout=600)


def test_killed_run_resumes_to_the_end(tmp_path, build_cache):
    _toy_tokenizer().save_pretrained(tmp_path / "tok")
    out = tmp_path / "run"
    config = tmp_path / "rl.toml"
    config.write_text(f"""
out_dir = "{out}"
[model]
shape = "tiny"
tokenizer = "{tmp_path / 'tok'}"
[tasks]
e2e = "{EXAMPLES / 'tasks'}"
[rl]
phase = "e2e"
e2e_steps = 3
[rollout]
tasks_per_step = 2
group = 4
max_new_tokens = 1
[reward]
backend = "cpu"
trials = 1
cache_dir = "{build_cache}"
[optim]
lr = 1e-2
[checkpoint]
every_steps = 1
export_dtype = "float32"
[metrics]
progress = false
tensorboard = false
plot = false
[debug]
sigkill_after_step = 2
""")
    first = _dice([str(config)])
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    again = _dice([str(config)])  # without --resume: refused, one line, exit 2
    assert again.returncode == 2 and "--resume" in again.stderr and "Traceback" not in again.stderr
    resumed = _dice([str(config), "--resume", "--set", "debug.sigkill_after_step=0"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step 3/3 e2e: reward" in resumed.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # one curve: no step logged twice
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["rollouts"] == 8 and sum(row["outcomes"].values()) == 8
    # every deceptive rollout is counted once by what its extension did (never built / not called / called)
    assert sum(row["deceptive_extension"].values()) == row["outcomes"].get("deceptive", 0)
    assert {"reward_mean", "exec", "kl", "clip_fraction", "rollout_s", "reward_s", "update_s", "lr"} <= set(row)
    rewards = sqlite3.connect(out / "rewards.sqlite").execute(
        "SELECT step, COUNT(*) FROM rewards GROUP BY step").fetchall()
    assert rewards == [(0, 8), (1, 8), (2, 8)]
    # each step's rollouts as the policy wrote them, joined to their rewards by candidate id
    logged = [json.loads(line) for line in gzip.open(out / "rollouts" / "step-00002.rank0.jsonl.gz", "rt")]
    paid = dict(sqlite3.connect(out / "rewards.sqlite").execute(
        "SELECT candidate_id, reward FROM rewards WHERE step = 2").fetchall())
    assert len(logged) == 8 and {r["candidate_id"]: r["reward"] for r in logged} == paid
    assert all(r["tokens"] == 1 and r["candidate_id"].startswith("step2/") for r in logged)
    assert {r["text"] for r in logged} <= {"", *_toy_tokenizer().get_vocab()}  # one token each (or a stop)
    assert sorted(p.name for p in (out / "rollouts").iterdir()) == [f"step-0000{i}.rank0.jsonl.gz" for i in range(3)]
    state = json.loads((out / "checkpoints" / "step-00000003" / "train_state.json").read_text())
    assert state["curricula"]["e2e"]["position"] == 6  # 3 steps x 2 tasks: the curriculum went on where it stopped
    assert (out / "final" / "config.json").is_file() and (out / "final" / "tokenizer.json").is_file()


_WORKER = '''
import sys
import torch
sys.path.insert(0, {tests!r})
from model_fixtures import VOCAB, tiny_model
from dice_kernels.model.tokenizer import load_tokenizer
from dice_kernels.sampling.decoder import SamplingConfig, decode
from dice_kernels.train.config import OptimConfig, ParallelConfig
from dice_kernels.train.distributed import parallelize
from dice_kernels.train.optim import build_optimizer
from dice_kernels.train.rl.config import RolloutConfig, UpdateConfig
from dice_kernels.train.rl.trainer import PolicyView, RLStep
from dice_kernels.train.rl.tracerl import Trajectory
from dice_kernels.train.run_loop import run_on_ranks

def work(cfg, resume, dist, console):
    model = tiny_model(0)
    initial = {{k: v.clone() for k, v in model.state_dict().items()}}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, VOCAB - 1, (n,), generator=g).tolist() for n in (3, 6, 9, 4, 7, 5, 8, 2)]
    out = decode(model, prompts, SamplingConfig(max_new_tokens=9, temperature=1.0, strategy="dynamic", seed=0), [7])
    trajs = [Trajectory(p, t, s) for p, t, s in zip(prompts, out.tokens, out.unmask_steps)]
    advantages = [1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25, -0.25]
    # 3 vs 2 micro-batches
    mine = range(8) if dist.world_size == 1 else (range(0, 5) if dist.rank == 0 else range(5, 8))
    parallelize(model, model.model.layers, ParallelConfig(), dist.device, forward_methods=("hidden_states",))
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4, warmup_fraction=0.0))
    step = RLStep(model, optimizer, load_tokenizer({tok!r}), None, RolloutConfig(tasks_per_step=2, group=4),
                  UpdateConfig(micro_rows=2, updates_per_step=2), 1.0, "dense", "cpu", dist)
    stats = step.update_policy([(i, trajs[i], advantages[i]) for i in mine], trajs[0])
    full = {{k: v.full_tensor() for k, v in model.state_dict().items()}}
    # the rollouts' view of the updated weights: every rank gathers them in place (a collective) and sees them whole
    with PolicyView(model, torch.float32, dist.device).weights(model) as plain:
        assert all(torch.equal(w, full[k]) for k, w in plain.state_dict().items()), dist.rank
    if dist.is_main:
        moved = max(float((full[k] - initial[k]).abs().max()) for k in full)
        torch.save({{"weights": full, "stats": stats, "moved": moved}}, {out!r})


# through the process group as `dice train` runs: the work returns, then shutdown() frees what it left in reference
# cycles and leaves the group (a rank aborted at exit without that, train/distributed.py)
run_on_ranks(work, None, False, None)
'''


def test_two_ranks_update_like_one(tmp_path):
    """The same 8 trajectories updated by 1 process, or split 5 / 3 over 2 processes, in two optimizer steps (the
    second rank has fewer micro-batches in one of them: it runs one with weight 0): the same weights and statistics,
    up to the order of float sums (Adam's steps divide by |g|: a tiny gradient's noise moves a weight by up to lr).
    Each rank's `PolicyView` then gathers the updated weights whole (the worker asserts it)."""
    import torch
    from model_fixtures import save_tiny_tokenizer

    save_tiny_tokenizer(tmp_path / "tok")
    results = {}
    for ranks in (1, 2):
        script = tmp_path / f"worker{ranks}.py"
        out = tmp_path / f"out{ranks}.pt"
        script.write_text(_WORKER.format(tests=str(EXAMPLES.parents[2] / "tests"), tok=str(tmp_path / "tok"),
                                         out=str(out)))
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                               str(ranks), str(script)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[ranks] = torch.load(out, weights_only=False)
    one, two = results[1], results[2]
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, rtol=0, atol=1e-5)
    assert one["moved"] > 5e-5  # Adam moves weights by about lr (1e-4): the tolerance is well below that
    # the loss is a near-cancelling sum of +-advantage terms (~1e-3 here): the ranks' summation order moves it by ~1e-7
    assert two["stats"]["loss"] == pytest.approx(one["stats"]["loss"], rel=1e-5, abs=1e-6)
    assert two["stats"]["grad_norm"] == pytest.approx(one["stats"]["grad_norm"], rel=1e-5)
    assert one["stats"]["grad_norm"] > 0

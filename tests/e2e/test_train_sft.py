"""`dice train sft` on a CPU: the tiny config learns, a run killed with SIGKILL and resumed gives the uninterrupted
loss curve, the export loads and generates, packed samples never see each other, two torchrun processes give the
loss of one, and bad inputs are one-line errors (exit 2)."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dice_kernels.cli import app
from dice_kernels import config_io
from dice_kernels.train.config import OptimConfig
from dice_kernels.train.metrics import read_metrics
from dice_kernels.train.sft.trainer import SFTConfig, run_sft
from model_fixtures import save_tiny_checkpoint, save_tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
_WORDS = ["import torch", "class ModelNew(nn.Module):", "def forward(self, x):", "return torch.relu(x)",
          "__global__ void kernel(float* out)", "hello world", "write a cuda kernel"]


def _rows(n: int) -> list[dict]:
    """Chat-formatted rows whose responses are a deterministic function of the prompt (learnable)."""
    rows = []
    for i in range(n):
        a, b = _WORDS[i % len(_WORDS)], _WORDS[(3 * i + 1) % len(_WORDS)]
        rows.append({"prompt": f"<|im_start|>user\n{a}<|im_end|>\n<|im_start|>assistant\n",
                     "response": f"{b} {a}<|im_end|>"})
    return rows


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A tiny model gains nothing from a second thread, and on a busy machine two threads per process thrash."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")} | {
    "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sft")
    save_tiny_tokenizer(root / "tok")
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(24)))
    return root


def _sets(workdir: Path, out: Path, **extra) -> list[str]:
    values = {"out_dir": out, "model.tokenizer": workdir / "tok", "data.path": workdir / "rows.jsonl",
              "data.cutoff": 64, "train.global_batch_rows": 4, "train.micro_batch_rows": 2,
              "metrics.progress": "false", "metrics.tensorboard": "false", "metrics.plot": "false",
              "checkpoint.export_dtype": "float32"} | extra
    return [f"{k}={v}" for k, v in values.items()]


def _config(workdir: Path, out: Path, **extra) -> SFTConfig:
    return config_io.load(SFTConfig, config_io.config_path("sft", "tiny"), _sets(workdir, out, **extra))


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["train", "sft", *args])
    return result.exit_code, result.output


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


@pytest.fixture(scope="module")
def uninterrupted(workdir) -> Path:
    """8 steps with resumable saves every 3 and a final export."""
    out = workdir / "straight"
    run_sft(_config(workdir, out, **{"train.max_steps": 8, "checkpoint.every_steps": 3}))
    return out


def test_tiny_config_learns(workdir):
    out = workdir / "learn"
    run_sft(_config(workdir, out, **{"train.max_steps": 60, "optim.lr": 3e-3, "checkpoint.at_end": "false",
                                     "checkpoint.every_steps": 0, "train.micro_batch_rows": 4}))
    losses = _losses(out)
    assert len(losses) == 60
    # medians: the 1/p weighting makes single steps spiky (a sample drawn with small t)
    first, last = statistics.median(losses[:10]), statistics.median(losses[-10:])
    assert last < 0.8 * first, f"median loss fell only from {first:.3f} to {last:.3f} in 60 steps"


def test_sigkilled_run_resumes_to_the_same_loss_curve(workdir, uninterrupted):
    out = workdir / "killed"
    cmd = [sys.executable, "-m", "dice_kernels", "train", "sft", "tiny"]
    for s in _sets(workdir, out, **{"train.max_steps": 8, "checkpoint.every_steps": 3,
                                    "debug.sigkill_after_step": 5}):
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert len(_losses(out)) == 5  # steps 4 and 5 were logged but never saved
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000003"]

    code, output = _cli("tiny", *sum((["--set", s] for s in _sets(
        workdir, out, **{"train.max_steps": 8, "checkpoint.every_steps": 3})), []), "--resume")
    assert code == 0, output
    assert "resumed from" in output and "step 3" in output
    resumed, straight = _losses(out), _losses(uninterrupted)
    assert len(resumed) == len(straight) == 8
    assert resumed == pytest.approx(straight, rel=1e-6, abs=1e-7)


def test_existing_run_needs_resume(workdir, uninterrupted):
    code, output = _cli("tiny", *sum((["--set", s] for s in _sets(workdir, uninterrupted)), []))
    assert code == 2 and "--resume" in output and "Traceback" not in output


def test_export_loads_and_generates(uninterrupted):
    from dice_kernels.model.checkpoint import load_model
    from dice_kernels.sampling.decoder import SamplingConfig
    from dice_kernels.sampling.generate import Generator

    final = uninterrupted / "final"
    model = load_model(final)
    assert model.config.mask_token_id is not None and model.config.block_size == 4
    out = Generator.from_checkpoint(final)(["write a cuda kernel"], SamplingConfig(max_new_tokens=8))[0]
    assert len(out.token_ids) == 8 or out.stopped
    assert all(t != model.config.mask_token_id for t in out.token_ids)
    assert (uninterrupted / "config.toml").is_file()
    saved = config_io.load(SFTConfig, uninterrupted / "config.toml")
    assert saved.train.max_steps == 8 and saved.checkpoint.every_steps == 3


def test_packed_samples_never_see_each_other(workdir):
    """The middle sample's hidden states do not move when its neighbours' tokens change; with the sample
    boundaries erased (one doc per row) they do, so the check can fail."""
    from dataclasses import replace

    from dice_kernels.train.model_setup import model_config, load_tokenizer_for
    from dice_kernels.train.sft.objective import corrupt, noisy_hidden_states, pack
    from model_fixtures import tiny_model

    cfg = _config(workdir, workdir / "unused")
    mcfg = model_config(cfg.model, load_tokenizer_for(cfg.model))
    model = tiny_model(vocab_size=mcfg.vocab_size, mask_token_id=mcfg.mask_token_id)
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(4, mcfg.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    samples = [(ids(5), ids(9)), (ids(6), ids(10)), (ids(3), ids(7))]
    changed = [(ids(5), ids(9)), samples[1], (ids(3), ids(7))]
    middle = None

    def hidden(batch_samples, merge_docs=False):
        batch = pack(batch_samples, 4, pad_id=0, row_len=64)
        nonlocal middle
        middle = batch.doc[0] == 1
        if merge_docs:
            batch = replace(batch, doc=torch.zeros_like(batch.doc))
        noise = corrupt(batch, mcfg.mask_token_id, torch.Generator().manual_seed(1))
        noisy_ids = torch.where(middle, noise.noisy_ids, batch.input_ids)  # same noise on the middle sample
        with torch.no_grad():
            return noisy_hidden_states(model, batch, noisy_ids, 4, backend="dense")[0, middle]

    assert torch.equal(hidden(samples), hidden(changed))
    assert not torch.allclose(hidden(samples, merge_docs=True), hidden(changed, merge_docs=True))


def test_two_torchrun_processes_give_the_loss_of_one(workdir):
    """Same global batch (4 rows): 1 process x 4 micro-batches vs 2 processes x 2. The noise is drawn for the
    whole batch and the loss normalised by its response tokens, so only the order of float sums differs."""
    ckpt = workdir / "ckpt"
    save_tiny_checkpoint(ckpt, seed=3)
    extra = {"model.shape": "", "model.checkpoint": ckpt, "model.tokenizer": "", "train.max_steps": 3,
             "train.micro_batch_rows": 1, "checkpoint.at_end": "false", "checkpoint.every_steps": 0}
    one = workdir / "one"
    run_sft(_config(workdir, one, **extra))
    two = workdir / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "dice_kernels", "train", "sft", "tiny"]
    for s in _sets(workdir, two, **extra):
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 rank(s)" in " ".join((proc.stdout + proc.stderr).split())
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-5)  # observed: 6e-8 after 3 steps


def test_bad_inputs_are_one_line_errors(workdir, tmp_path):
    base = _sets(workdir, tmp_path / "run")
    sets = lambda *more: sum((["--set", s] for s in [*base, *more]), [])  # noqa: E731

    code, out = _cli("tiny", *sets("optim.lrr=1"))
    assert code == 2 and "optim.lrr" in out and "valid keys in optim: lr" in out

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_rows(1)[0]) + "\n{not json\n")
    code, out = _cli("tiny", *sets(f"data.path={bad}"))
    assert code == 2 and f"{bad}:2" in out and "not valid JSON" in out

    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text(json.dumps({"prompt": "x"}) + "\n")
    code, out = _cli("tiny", *sets(f"data.path={no_field}"))
    assert code == 2 and f"{no_field}:1" in out and "'response'" in out

    code, out = _cli("tiny", *sets(f"data.path={tmp_path / 'absent.jsonl'}"))
    assert code == 2 and "absent.jsonl" in out and "not found" in out

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    plain = tmp_path / "nomask"  # a checkpoint whose tokenizer and config.json know no mask token
    vocab = {t: i for i, t in enumerate(["<|endoftext|>", "<|im_end|>", "a", "b"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>").save_pretrained(str(plain))
    from model_fixtures import tiny_model
    from dice_kernels.model import save_model

    save_model(tiny_model(mask_token_id=None), plain)
    code, out = _cli("tiny", *sets("model.shape=", f"model.checkpoint={plain}", "model.tokenizer="))
    assert code == 2 and "no mask token" in out and str(plain) in out
    assert all("Traceback" not in o for o in (out,))


def test_memory_plan_for_8b(workdir):
    sets = ["model.shape=8B", f"model.tokenizer={workdir / 'tok'}", "model.checkpoint="]
    args = sum((["--set", s] for s in sets), [])
    code, out = _cli("sdar-8b", *args, "--plan", "--gpus", "8", "--gpu-memory", "80")
    assert code == 0, out
    assert "8.191 B" in out
    assert "3.8 GiB" in out  # fp32 weights: 8.19e9 x 4 B / 8 GPUs
    assert "peak per GPU with AC:" in out and "fits  <- this config" in out
    code, out = _cli("sdar-8b", *args, "--plan", "--gpus", "1", "--gpu-memory", "141")
    assert code == 0 and "does NOT fit  <- this config" in out  # 16 B/param of states alone is 122 GiB


@dataclass
class _OtherStage:  # a stage whose section defaults differ from the section class's (RL: lr 1e-6)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6, warmup_fraction=0.0))


def test_config_overrides_round_trip_and_shipped_configs(workdir, tmp_path):
    cfg = _config(workdir, tmp_path, **{"optim.betas": "0.9,0.95", "parallel.activation_checkpointing": "yes"})
    assert cfg.optim.betas == (0.9, 0.95) and cfg.parallel.activation_checkpointing is True
    assert config_io.load(SFTConfig, config_io.save(cfg, tmp_path)) == cfg
    (tmp_path / "typo.toml").write_text('[model]\nshape = "tiny"\ntokenizer = "t"\n[data]\npath = "x"\nbatch = 3\n')
    with pytest.raises(config_io.ConfigError, match="unknown config key 'data.batch'.*valid keys in data: path"):
        config_io.load(SFTConfig, tmp_path / "typo.toml")
    other = config_io.load(_OtherStage, None, ["optim.grad_clip=0.5"])
    assert (other.optim.lr, other.optim.warmup_fraction, other.optim.grad_clip) == (1e-6, 0.0, 0.5)
    code, out = _cli("tiny", "--show", "--set", "train.epochs=2")
    assert code == 0 and "[train]\nepochs = 2\n" in out and "[parallel]" in out
    for name in ("sdar-1.7b", "sdar-4b", "sdar-8b"):
        c = config_io.load(SFTConfig, config_io.config_path("sft", name))
        assert (c.optim.lr, c.optim.schedule, c.optim.warmup_fraction, c.train.epochs, c.data.cutoff,
                c.optim.grad_clip) == (1e-5, "constant", 0.03, 3, 6144, 1.0)


def test_cutoff_counts_and_epoch_shuffles(workdir):
    from dice_kernels.model.tokenizer import load_tokenizer
    from dice_kernels.train.sft.data import SFTData, SFTDataConfig, tokenize

    tok = load_tokenizer(workdir / "tok")
    rows = _rows(6) + [{"prompt": "hello world", "response": "import torch " * 20}]
    for overflow, kept in (("truncate", 7), ("drop", 6)):
        cfg = SFTDataConfig(path="x", cutoff=72, overflow=overflow)
        samples, stats = tokenize(rows, tok, cfg, block_size=4)
        assert len(samples) == kept and stats.rows == 7
        assert (stats.truncated, stats.dropped) == ((1, 0) if overflow == "truncate" else (0, 1))
        assert all(-(-(len(p) + len(r)) // 4) * 4 <= 72 for p, r in samples)
    data = SFTData.load(SFTDataConfig(path=str(workdir / "rows.jsonl"), cutoff=48), tok, 4, 0, 2, seed=0)
    again = SFTData.load(SFTDataConfig(path=str(workdir / "rows.jsonl"), cutoff=48), tok, 4, 0, 2, seed=0)
    assert data.epoch_rows(0) == again.epoch_rows(0) and data.epoch_rows(0) != data.epoch_rows(1)
    assert sorted(i for row in data.epoch_rows(1) for i in row) == list(range(len(data.samples)))
    assert torch.equal(data.step(5).batch.input_ids, again.step(5).batch.input_ids)


@pytest.mark.gpu
def test_gpu_run_with_flex_bf16_and_activation_checkpointing(workdir):
    out = workdir / "gpu"
    run_sft(_config(workdir, out, **{"train.max_steps": 4, "parallel.activation_checkpointing": "true",
                                     "checkpoint.every_steps": 2}))
    records = read_metrics(out)
    assert len(records) == 4 and all(r["max_memory_gib"] > 0 for r in records)
    assert all(r["loss"] == r["loss"] for r in records)  # finite: flex + bf16 + AC ran forward and backward
    from dice_kernels.model.checkpoint import load_model

    assert load_model(out / "final").config.block_size == 4


def test_real_qwen3_tokenizer_on_shipped_example_pairs_from_parquet(shared_data, tmp_path):
    """The tiny config with the real Qwen3 tokenizer (no mask token: SDAR's convention puts it at
    len(tokenizer) = 151669) on real chat-format rows (the shipped CPU example pairs), read from Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dice_kernels.prompts import chat_prompt, chat_response, code_block, e2e_user

    examples = REPO / "src" / "dice_kernels" / "examples"
    rows = []
    for solution in sorted((examples / "solutions" / "cpu" / "level1").glob("*/correct.py")):
        task = next((examples / "tasks").rglob(f"{solution.parent.name}.py"))
        rows.append({"prompt": chat_prompt(e2e_user(task.read_text(), backend="cpu")),
                     "response": chat_response(code_block(solution.read_text()))})
    pq.write_table(pa.Table.from_pylist(rows * 2), tmp_path / "sft.parquet")
    out = tmp_path / "run"
    code, output = _cli("tiny", "--set", f"model.tokenizer={shared_data / 'tokenizers' / 'qwen3'}",
                        "--set", f"data.path={tmp_path / 'sft.parquet'}", "--set", f"out_dir={out}",
                        "--set", "data.cutoff=1536", "--set", "train.max_steps=1", "--set", "train.global_batch_rows=1",
                        "--set", "train.micro_batch_rows=1", "--set", "metrics.progress=false",
                        "--set", "metrics.tensorboard=false")
    assert code == 0, output
    assert f"{len(rows) * 2} rows" in " ".join(output.split())
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["mask_token_id"] == 151669 and config["vocab_size"] == 151680
    assert len(read_metrics(out)) == 1 and (out / "loss_curve.png").is_file()


_SEGMENTS_EXPANDABLE = """
import torch
from dice_kernels.train.distributed import init_distributed, shutdown
dist = init_distributed()
kept = torch.empty(1 << 20, device=dist.device)
print(all(s["is_expandable"] for s in torch.cuda.memory._snapshot()["segments"]))
shutdown()
"""


@pytest.mark.gpu
@pytest.mark.parametrize("user_setting, expandable", [(None, "True"), ("expandable_segments:False", "False")])
def test_training_processes_allocate_expandable_segments_unless_the_user_says_otherwise(user_setting, expandable):
    """A trainer's rollouts and update alternate in one process; expandable segments let the update reuse the
    rollouts' freed memory (an SDAR-4B step ran out of an H100 without them). The default must reach the
    allocator (set before CUDA's first allocation), and a user's own PYTORCH_CUDA_ALLOC_CONF must win."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "WORLD_SIZE")}
    if user_setting:
        env["PYTORCH_CUDA_ALLOC_CONF"] = user_setting
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _SEGMENTS_EXPANDABLE], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == expandable

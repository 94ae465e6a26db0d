"""`dice demo`: the recipe end to end at small scale, through the project's own stages. Build the world and its
tokenizer, SFT a randomly initialised block-diffusion model (train/sft.py), then two RL arms from that checkpoint
(train/rl.py): end-to-end RL alone, and BiC-RL (infilling, then end-to-end); benchmark the three checkpoints on the
held-out families (bench/run.py) and write one report. Each stage leaves its outputs in its own folder and is
skipped when they exist, so an interrupted demo resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

from dice_kernels.demo.config import DemoConfig
from dice_kernels.demo.world import WorldFiles, build_world, write_world

ARMS = ("sft", "sft_e2e_rl", "sft_bicrl")  # SFT only; SFT + end-to-end RL; SFT + infilling RL + end-to-end RL
ARM_TITLES = {"sft": "SFT only", "sft_e2e_rl": "SFT + e2e RL", "sft_bicrl": "SFT + infill + e2e RL (BiC-RL)"}


@dataclasses.dataclass
class Gap:
    """A stage that could not run, and why: reported as such, never replaced by something else."""

    stage: str
    reason: str


@dataclasses.dataclass
class Timings:
    """Seconds per stage, saved after every stage (<out>/timings.json), so a resumed demo still reports them."""

    path: Path
    seconds: dict[str, float]

    @classmethod
    def load(cls, path: Path) -> Timings:
        return cls(path, json.loads(path.read_text()) if path.is_file() else {})

    def run(self, name: str, fn: Callable, *args):
        """Run one stage and record its seconds; a stage found done (under a second) keeps the seconds it took
        when it ran."""
        began = time.perf_counter()
        value = fn(*args)
        seconds = round(time.perf_counter() - began, 1)
        if seconds >= 1.0 or name not in self.seconds:
            self.seconds[name] = seconds
            self.seconds["total"] = round(sum(v for k, v in self.seconds.items() if k != "total"), 1)
            self.path.write_text(json.dumps(self.seconds, indent=1))
        return value


def stage_world(cfg: DemoConfig) -> WorldFiles:
    w = cfg.world
    tasks = build_world(w.seed, w.n_train, w.n_heldout, w.heldout_fraction)
    return write_world(tasks, cfg.out / "world", cfg.backend)


def stage_tokenizer(cfg: DemoConfig, files: WorldFiles) -> Path:
    from dice_kernels.data.records import read_jsonl
    from dice_kernels.demo.tokenizer import train_tokenizer

    out = cfg.out / "tokenizer"
    if not (out / "tokenizer.json").is_file():
        train_tokenizer((r["prompt"] + r["response"] for r in read_jsonl(files.sft)), out, cfg.model.vocab_size)
    return out


def stage_init(cfg: DemoConfig, tokenizer_dir: Path) -> Path:
    """A randomly initialised checkpoint of the demo's shape (the vocabulary the tokenizer learned, rounded up)."""
    import torch

    from dice_kernels.model import BlockDiffusionLM, ModelConfig, save_model
    from dice_kernels.model.tokenizer import load_tokenizer

    out = cfg.out / "init"
    if (out / "config.json").is_file():
        return out
    tok = load_tokenizer(tokenizer_dir)
    shape = dataclasses.asdict(cfg.model)
    vocab = -(-len(tok) // 64) * 64
    mcfg = ModelConfig(**(shape | {"vocab_size": vocab}), rope_theta=1e4, tie_word_embeddings=True,
                       max_position_embeddings=4096, mask_token_id=tok.mask_token_id, dtype="float32")
    torch.manual_seed(cfg.world.seed)
    model = BlockDiffusionLM(mcfg)
    with torch.no_grad():  # the SFT trainer's random init: N(0, 0.02), norms at 1
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else 0.02 * torch.randn_like(p))
    save_model(model, out, tokenizer_dir)
    return out


def _longest(files: WorldFiles, tokenizer_dir: Path) -> int:
    """The longest SFT sample in tokens, block-padded: the packing cutoff, so no sample is cut."""
    from dice_kernels.data.records import read_jsonl
    from dice_kernels.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    longest = max(len(tok.encode(r["prompt"] + r["response"], add_special_tokens=False)) for r in read_jsonl(files.sft))
    return -(-(longest + 4) // 4) * 4


def stage_sft(cfg: DemoConfig, files: WorldFiles, init: Path, tokenizer_dir: Path) -> Path:
    from dice_kernels.train.config import CheckpointConfig, MetricsConfig, ModelSection, OptimConfig
    from dice_kernels.train.sft import SFTConfig, SFTLoopConfig, run_sft
    from dice_kernels.train.sft_data import SFTDataConfig

    out = cfg.out / "sft"
    if (out / "final" / "config.json").is_file():
        return out / "final"
    s = cfg.sft
    cutoff = _longest(files, tokenizer_dir)
    sft = SFTConfig(
        out_dir=str(out), model=ModelSection(checkpoint=str(init)),
        data=SFTDataConfig(path=str(files.sft), cutoff=cutoff, seq_len=max(s.row_tokens, cutoff)),
        train=SFTLoopConfig(max_steps=s.steps, global_batch_rows=s.batch_rows, micro_batch_rows=s.batch_rows,
                            seed=cfg.world.seed),
        optim=OptimConfig(lr=s.lr, betas=(0.9, 0.95), warmup_fraction=0.1, schedule="cosine", min_lr_fraction=0.1),
        checkpoint=CheckpointConfig(every_steps=max(50, s.steps // 4), keep=1, export_dtype="float32",
                                    export_every_steps=s.export_every),
        metrics=MetricsConfig(log_every=10, progress=cfg.progress, tensorboard=False),
    )
    return run_sft(sft, resume=True)


def stage_bench(cfg: DemoConfig, checkpoint: Path, files: WorldFiles, arm: str) -> dict:
    """`dice bench` of one checkpoint on the held-out tasks: greedy, DICE's decoding, the harness with timing."""
    from dice_kernels.bench.config import BenchConfig
    from dice_kernels.bench.run import run as bench_run
    from dice_kernels.harness import EvalConfig, TimingConfig
    from dice_kernels.sampling.decoder import SamplingConfig

    out = cfg.out / "bench" / arm
    if (out / "summary.json").is_file():  # written last: the run is complete
        return json.loads((out / "summary.json").read_text())
    b = cfg.bench
    bench = BenchConfig(out=out, checkpoint=checkpoint, tasks=files.heldout_tasks,
                        samples=b.samples, batch_size=64, dtype="float32",
                        decoding=SamplingConfig(max_new_tokens=b.max_new_tokens, block_size=4, steps=4,
                                                strategy="static", temperature=0.0),
                        eval=EvalConfig(backend=cfg.backend, timing=TimingConfig(max_s=1.0)))
    return bench_run(bench, command=f"dice demo ({arm})", progress=cfg.progress, echo=lambda m: None)


def stage_rl(cfg: DemoConfig, files: WorldFiles, start: Path, arm: str) -> Path:
    """One RL arm from the SFT checkpoint: `sft_e2e_rl` runs end-to-end RL only; `sft_bicrl` runs the infilling
    phase first, then the same end-to-end steps (DICE's schedule)."""
    from dice_kernels.train.config import CheckpointConfig, MetricsConfig, ModelSection, OptimConfig
    from dice_kernels.train.reward import RewardConfig
    from dice_kernels.train.rl import RLConfig, RLLoopConfig, RLTasksConfig, RolloutConfig, UpdateConfig, run_rl

    out = cfg.out / arm
    if (out / "final" / "config.json").is_file():
        return out / "final"
    r = cfg.rl
    loop = (RLLoopConfig(phase="e2e", infill_steps=0, e2e_steps=r.e2e_steps) if arm == "sft_e2e_rl"
            else RLLoopConfig(phase="schedule", infill_steps=r.infill_steps, e2e_steps=r.e2e_steps))
    rl = RLConfig(
        out_dir=str(out), model=ModelSection(checkpoint=str(start)),
        # mixed order: a handful of steps taken in level order would only ever see single operators
        tasks=RLTasksConfig(infill=str(files.rl_infill), e2e=str(files.rl_e2e), order="mixed", seed=cfg.world.seed),
        rl=loop,
        rollout=RolloutConfig(tasks_per_step=r.tasks_per_step, group=r.group, max_new_tokens=cfg.bench.max_new_tokens,
                              temperature=r.temperature, batch_rows=r.tasks_per_step * r.group, seed=cfg.world.seed),
        update=UpdateConfig(micro_rows=r.group * 2),
        reward=RewardConfig(backend=cfg.backend, trials=2),
        optim=OptimConfig(lr=r.lr, warmup_fraction=0.0),
        # a resumable state after every step: a step costs a round of builds, a save a fraction of a second
        checkpoint=CheckpointConfig(every_steps=1, keep=1, export_dtype="float32"),
        metrics=MetricsConfig(log_every=1, progress=cfg.progress, tensorboard=False),
    )
    return run_rl(rl, resume=True)


def _arm_row(summary: dict | Gap) -> dict:
    if isinstance(summary, Gap):
        return {"status": "not run", "reason": summary.reason}
    m = summary["metrics"]["all"]
    n = m["n"]
    return {"status": "ran", "n": n, "exec": m["exec_rate"], "fast_1": m["fast"].get("fast_1"),
            "deceptive_rate": m["outcomes"].get("deceptive", 0) / n if n else 0.0, "outcomes": m["outcomes"]}


def _curve(run_dir: Path, key: str) -> list[tuple[int, float, str]]:
    """(step, value, phase) rows of a trainer's metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["step"], r[key], r.get("phase", "")) for r in rows if key in r and "step" in r]


def plot_curves(cfg: DemoConfig, path: Path) -> bool:
    """SFT loss (left) and each RL arm's mean reward per step (right), as one PNG; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    sft = _curve(cfg.out / "sft", "loss")
    left.plot([s for s, _, _ in sft], [v for _, v, _ in sft], color="#1f77b4")
    left.set(title="SFT loss", xlabel="step", yscale="log")
    for arm, color in (("sft_e2e_rl", "#ff7f0e"), ("sft_bicrl", "#2ca02c")):
        rows = _curve(cfg.out / arm, "reward_mean")
        if rows:
            right.plot([s for s, _, _ in rows], [v for _, v, _ in rows], marker="o", color=color, label=ARM_TITLES[arm],
                       markersize=8 if arm == "sft_e2e_rl" else 5)
            infill = [s for s, _, p in rows if p == "infill"]
            if infill:
                right.axvspan(min(infill) - 0.5, max(infill) + 0.5, color=color, alpha=0.08)
    right.set(title="RL mean reward per step (shaded: infilling phase)", xlabel="step", ylim=(-0.05, 1.05))
    if right.get_legend_handles_labels()[0]:  # no RL arm yet when the report is written after the SFT arm
        right.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(cfg: DemoConfig, arms: dict[str, dict | Gap], timings: dict, gaps: list[Gap]) -> dict:
    rows = {arm: _arm_row(summary) for arm, summary in arms.items()}
    report = {"scale": cfg.scale, "backend": cfg.backend, "config": json.loads(json.dumps(dataclasses.asdict(cfg),
                                                                                          default=str)),
              "arms": rows, "seconds": timings, "gaps": [dataclasses.asdict(g) for g in gaps]}
    (cfg.out / "report.json").write_text(json.dumps(report, indent=1))
    pct = lambda x: "–" if x is None else f"{100 * x:.1f}"  # noqa: E731
    lines = [f"# dice demo ({cfg.scale} scale, {cfg.backend} kernels)", "",
             f"Held-out benchmark: {cfg.world.n_heldout} tasks from program families never trained on "
             f"(world seed {cfg.world.seed}); greedy decoding, {cfg.bench.samples} sample(s) per task.", "",
             "| arm | n | Exec % | fast_1 % | deceptive % |", "|---|---|---|---|---|"]
    for arm in ARMS:
        row = rows.get(arm, {"status": "not run", "reason": "not reached"})
        if row["status"] == "ran":
            lines.append(f"| {ARM_TITLES[arm]} | {row['n']} | {pct(row['exec'])} | {pct(row['fast_1'])} | "
                         f"{pct(row['deceptive_rate'])} |")
        else:
            lines.append(f"| {ARM_TITLES[arm]} | – | not run | – | – |")
    lines += ["", "Exec: correct and not deceptive; fast_1: that, and faster than PyTorch eager (95% interval above 1).",
              "", "![curves](curves.png)", "", "## Seconds per stage", "",
              "| stage | seconds |", "|---|---|", *[f"| {k} | {v} |" for k, v in timings.items()],
              "", "(a stage a resumed demo found done keeps the seconds it took when it ran)"]
    if gaps:
        lines += ["", "## Gaps (stages that did not run)", "", *[f"- **{g.stage}**: {g.reason}" for g in gaps]]
    (cfg.out / "report.md").write_text("\n".join(lines) + "\n")
    plot_curves(cfg, cfg.out / "curves.png")
    return report


def _missing(module: str) -> str | None:
    """Why a stage's trainer cannot be imported (None when it can)."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as e:
        return f"{module} is not available in this checkout ({e})"
    return None


def run_demo(cfg: DemoConfig, echo: Callable[[str], None] = print) -> dict:
    """Every stage in order (each skipped when its outputs exist); returns the report (also report.json/.md)."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    timings = Timings.load(cfg.out / "timings.json")
    gaps: list[Gap] = []
    echo(f"world: {cfg.world.n_train} train + {cfg.world.n_heldout} held-out tasks (seed {cfg.world.seed})")
    files = timings.run("world", stage_world, cfg)
    tokenizer = timings.run("tokenizer", stage_tokenizer, cfg, files)
    init = timings.run("init", stage_init, cfg, tokenizer)
    echo(f"SFT: {cfg.sft.steps} steps from a random init -> {cfg.out / 'sft'}")
    sft = timings.run("sft", stage_sft, cfg, files, init, tokenizer)
    why = _missing("dice_kernels.train.rl")
    arms: dict[str, dict | Gap] = {}
    for arm in ARMS:  # each arm is benchmarked as soon as it is trained, so a stopped demo has its finished arms
        if arm != "sft" and why:
            arms[arm] = Gap(arm, why)
            gaps.append(arms[arm])
            continue
        checkpoint = sft
        if arm != "sft":
            echo(f"RL ({ARM_TITLES[arm]}) -> {cfg.out / arm}")
            checkpoint = timings.run(arm, stage_rl, cfg, files, sft, arm)
        echo(f"bench ({ARM_TITLES[arm]}) on {cfg.world.n_heldout} held-out tasks -> {cfg.out / 'bench' / arm}")
        arms[arm] = timings.run(f"bench {arm}", stage_bench, cfg, checkpoint, files, arm)
        report = write_report(cfg, arms, timings.seconds, gaps)  # after every arm: a stopped demo keeps its table
    echo(f"report: {cfg.out / 'report.md'}")
    return report

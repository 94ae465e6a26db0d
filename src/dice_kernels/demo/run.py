"""`dice demo`: the recipe end to end at small scale, through the project's own stages. Build the world and its
tokenizer, SFT a randomly initialised block-diffusion model (train/sft/), then the configured RL arms from that
checkpoint (train/rl/: end-to-end RL or BiC-RL, each with DICE's reward or ours), score each arm's early and late
rollouts with the robust check (demo/rollout_check.py); benchmark every arm on the
held-out instances of trained families and on never-trained families (bench/run.py, always with the robust check),
each RL export on the held-out set (the learning curve), and write one report with intervals and paired
differences (demo/report.py). Each stage leaves its outputs in its own folder and is skipped when they exist, so an
interrupted demo resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from dice_kernels.demo.config import ARMS, DemoConfig
from dice_kernels.demo.prompt_reading import stage_operator_copy
from dice_kernels.demo.rollout_check import stage_rollout_check
from dice_kernels.demo.world import WorldFiles, build_world, write_world


@dataclasses.dataclass
class Gap:
    """A stage that could not run, and why: reported as such, never replaced by something else."""

    stage: str
    reason: str


@dataclasses.dataclass
class Timings:
    """Seconds per stage, saved after every stage (<out>/timings.json), so a resumed demo still reports them. A stage
    that was stopped (Ctrl-C, or SIGTERM from `timeout` or a scheduler: `stop_on_sigterm`) or failed keeps the seconds
    it ran (<out>/timings-stopped.json); they are added to its seconds when a later run finishes it, so a stage that
    ran across several invocations reports all of its time."""

    path: Path
    seconds: dict[str, float]
    stopped: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> Timings:
        stopped = path.with_name("timings-stopped.json")
        return cls(path, json.loads(path.read_text()) if path.is_file() else {},
                   json.loads(stopped.read_text()) if stopped.is_file() else {})

    def run(self, name: str, fn: Callable, *args):
        """Run one stage and record its seconds; a stage found done (under a second) keeps the seconds it took
        when it ran."""
        began = time.perf_counter()
        try:
            value = fn(*args)
        except BaseException:
            self.stopped[name] = round(self.stopped.get(name, 0.0) + time.perf_counter() - began, 1)
            self._save()
            raise
        seconds = round(time.perf_counter() - began + self.stopped.pop(name, 0.0), 1)
        if seconds >= 1.0 or name not in self.seconds:
            self.seconds.pop("total", None)  # re-added last, so the report's table ends with it
            self.seconds[name] = seconds
            self.seconds["total"] = round(sum(self.seconds.values()), 1)
        self._save()
        return value

    def _save(self) -> None:
        self.path.write_text(json.dumps(self.seconds, indent=1))
        self.path.with_name("timings-stopped.json").write_text(json.dumps(self.stopped, indent=1))


@contextmanager
def stop_on_sigterm():
    """SIGTERM (what `timeout` and cluster schedulers send first) raises KeyboardInterrupt in the main thread, as
    Ctrl-C does, so that a stopped stage records its seconds and the harness's workers are shut down, instead of the
    process dying where it stands. Outside the main thread (signals cannot be set there) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"stopped by signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stage_world(cfg: DemoConfig) -> WorldFiles:
    return write_world(build_world(cfg.world.seed, cfg.world.sizes()), cfg.out / "world", cfg.backend)


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


def _longest(files: WorldFiles, tokenizer_dir: Path, fields: tuple[str, ...] = ("prompt", "response")) -> int:
    """The longest SFT sample (or part of one) in tokens, block-padded: the packing cutoff, so no sample is cut;
    of the responses alone, the generation budget, so no template solution is cut."""
    from dice_kernels.data.records import read_jsonl
    from dice_kernels.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    longest = max(len(tok.encode("".join(r[f] for f in fields), add_special_tokens=False))
                  for r in read_jsonl(files.sft))
    return -(-(longest + 4) // 4) * 4


def new_tokens(cfg: DemoConfig, files: WorldFiles) -> int:
    """bench.max_new_tokens, or (0) the longest SFT response: op-by-op solutions are the longest (~175 tokens in
    the CUDA world, ~145 in the C++ one, against ~115 for fused ones)."""
    return cfg.bench.max_new_tokens or _longest(files, cfg.out / "tokenizer", ("response",))


def stage_sft(cfg: DemoConfig, files: WorldFiles, init: Path, tokenizer_dir: Path) -> Path:
    from dice_kernels.train.config import CheckpointConfig, MetricsConfig, ModelSection, OptimConfig
    from dice_kernels.train.sft.trainer import SFTConfig, SFTLoopConfig, run_sft
    from dice_kernels.train.sft.data import SFTDataConfig

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


def stage_bench(cfg: DemoConfig, files: WorldFiles, checkpoint: Path, tasks: Path, out: Path,
                timed: bool = True) -> dict:
    """`dice bench` of one checkpoint on one task set: DICE's decoding (greedy, or bench.samples programs a task
    sampled at bench.temperature), the harness with the robust check, and timing where fast_1 is reported (`timed`:
    an arm's final held-out and novel benchmarks). The validation and learning-curve benchmarks are read for Exec
    alone, and on a GPU each timed candidate holds the device alone for up to `max_s` a side."""
    from dice_kernels.bench.config import BenchConfig
    from dice_kernels.bench.run import run as bench_run
    from dice_kernels.harness import EvalConfig, TimingConfig
    from dice_kernels.sampling.decoder import SamplingConfig

    if (out / "summary.json").is_file():  # written last: the run is complete
        return json.loads((out / "summary.json").read_text())
    b = cfg.bench
    bench = BenchConfig(out=out, checkpoint=checkpoint, tasks=tasks,
                        samples=b.samples, batch_size=64, dtype="float32",
                        decoding=SamplingConfig(max_new_tokens=new_tokens(cfg, files), block_size=4, steps=4,
                                                strategy="static", temperature=b.temperature,
                                                seed=cfg.world.seed if b.temperature else None),
                        # arms share most outputs: a program benchmarked for one arm is not run again for the
                        # next, and keeps one time, so fast_1 differs between arms only where programs do
                        eval=EvalConfig(backend=cfg.backend, timing=TimingConfig(enabled=timed, max_s=1.0),
                                        reuse_verdicts=True))
    return bench_run(bench, command=f"dice demo ({out.relative_to(cfg.out)})", progress=cfg.progress,
                     echo=lambda m: None)


def rl_sections(cfg: DemoConfig, files: WorldFiles) -> tuple:
    """(RolloutConfig, UpdateConfig, OptimConfig) of the demo's RL: what every arm and benchmarks/rl_learning_probe.py
    train with."""
    from dice_kernels.train.config import OptimConfig
    from dice_kernels.train.rl.config import RolloutConfig, UpdateConfig

    r = cfg.rl
    return (RolloutConfig(tasks_per_step=r.tasks_per_step, group=r.group, max_new_tokens=new_tokens(cfg, files),
                          temperature=r.temperature, strategy=r.strategy, batch_rows=r.tasks_per_step * r.group,
                          seed=cfg.world.seed),
            UpdateConfig(micro_rows=r.group * 2, rows_per_update=r.rows_per_update, reset_optimizer=r.reset_optimizer),
            OptimConfig(lr=r.lr, warmup_fraction=0.0))


def stage_rl(cfg: DemoConfig, files: WorldFiles, start: Path, arm: str) -> Path:
    """One RL arm from the SFT checkpoint into cfg.rl_dir(arm): end-to-end RL only, or the infilling phase first,
    then the same end-to-end steps (DICE's schedule); rewarded by DICE's rule or ours (demo/config.py's ARMS)."""
    from dice_kernels.train.config import CheckpointConfig, MetricsConfig, ModelSection
    from dice_kernels.train.rl.config import RLConfig, RLLoopConfig, RLTasksConfig
    from dice_kernels.train.rl.trainer import run_rl

    out = cfg.rl_dir(arm)
    if (out / "final" / "config.json").is_file():
        return out / "final"
    r = cfg.rl
    spec = ARMS[arm]
    rollout, update, optim = rl_sections(cfg, files)
    loop = (RLLoopConfig(phase="e2e", infill_steps=0, e2e_steps=r.e2e_steps) if spec.phase == "e2e"
            else RLLoopConfig(phase="schedule", infill_steps=r.infill_steps, e2e_steps=r.e2e_steps))
    rl = RLConfig(
        out_dir=str(out), model=ModelSection(checkpoint=str(start)),
        # mixed order: a handful of steps taken in level order would only ever see single operators
        tasks=RLTasksConfig(infill=str(files.rl_infill), e2e=str(files.rl_e2e), order="mixed", seed=cfg.world.seed),
        rl=loop, rollout=rollout, update=update,
        reward=cfg.reward(spec.rule, spec.speed),
        optim=optim,
        # a resumable state after every step: a step costs a round of builds, a save a fraction of a second
        checkpoint=CheckpointConfig(every_steps=1, keep=1, export_dtype="float32", export_every_steps=r.export_every),
        metrics=MetricsConfig(log_every=1, progress=cfg.progress, tensorboard=False),
    )
    return run_rl(rl, resume=True)


def _missing(module: str) -> str | None:
    """Why a stage's trainer cannot be imported (None when it can)."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as e:
        return f"{module} is not available in this checkout ({e})"
    return None


def bench_arm(cfg: DemoConfig, timings: Timings, files: WorldFiles, arm: str, checkpoint: Path) -> None:
    """An arm's final checkpoint on the held-out and the novel tasks, then each of its earlier RL exports on the
    held-out tasks (the learning curve; the report adds the final one and SFT's as step 0)."""
    bench = cfg.out / "bench" / arm
    timings.run(f"bench {arm}", stage_bench, cfg, files, checkpoint, files.heldout_tasks, bench / "heldout")
    if cfg.world.n_novel:
        timings.run(f"bench {arm} novel", stage_bench, cfg, files, checkpoint, files.novel_tasks, bench / "novel")
    last = len(cfg.rl_phases(arm))
    for export in sorted((cfg.rl_dir(arm) / "export").glob("step-*")):
        if int(export.name.split("-")[1]) >= last:  # the final checkpoint, benchmarked above
            continue
        timings.run(f"bench {arm} {export.name}", stage_bench, cfg, files, export, files.heldout_tasks,
                    bench / f"heldout-{export.name}", False)


def tune_lr(cfg: DemoConfig, timings: Timings, files: WorldFiles, sft: Path,
            echo: Callable[[str], None]) -> DemoConfig:
    """rl.lr_grid: the first RL arm once per rate, each run benchmarked on the validation split; returns cfg with
    rl.lr the rate of the highest validation Exec (the smaller rate on a tie: the smaller move from SFT). The
    held-out tasks play no part in the choice."""
    from dice_kernels.demo.report import bench_scores
    from dice_kernels.demo.stats import rate_interval

    arm, mean_exec = cfg.tuned_arm(), {}
    # SFT on the same split: what the tuning table pairs each rate against (read nowhere else, so run only here)
    timings.run("bench sft valid", stage_bench, cfg, files, sft, files.valid_tasks, cfg.valid_bench("sft"), False)
    for lr in cfg.rl.lr_grid:
        trial = cfg.at_lr(lr)
        echo(f"tune rl.lr: {ARMS[arm].title} at lr {lr:g} -> {trial.rl_dir(arm)}")
        checkpoint = timings.run(f"tune {arm} lr {lr:g}", stage_rl, trial, files, sft, arm)
        timings.run(f"bench {arm} lr {lr:g} valid", stage_bench, trial, files, checkpoint, files.valid_tasks,
                    trial.valid_bench(arm), False)
        # the value the report's tuning table shows for this rate
        mean_exec[lr] = rate_interval(bench_scores(trial.valid_bench(arm))["exec"]).value
    chosen = max(sorted(mean_exec), key=lambda lr: mean_exec[lr])  # max keeps the first (smallest) of a tie
    echo("validation Exec per rate: " + ", ".join(f"{lr:g}: {100 * v:.1f} %" for lr, v in mean_exec.items())
         + f" -> rl.lr = {chosen:g}")
    return cfg.at_lr(chosen)


def run_demo(cfg: DemoConfig, echo: Callable[[str], None] = print) -> dict:
    """Every stage in order (each skipped when its outputs exist); returns the report (also report.json/.md)."""
    from dice_kernels.demo.report import write_report

    cfg.out.mkdir(parents=True, exist_ok=True)
    timings = Timings.load(cfg.out / "timings.json")
    gaps: list[Gap] = []
    w = cfg.world
    echo(f"world: {w.n_train} train, {w.n_rl or 'the train'} RL, {w.n_valid} validation, {w.n_heldout} held-out, "
         f"{w.n_novel} novel tasks (seed {w.seed})")
    files = timings.run("world", stage_world, cfg)
    tokenizer = timings.run("tokenizer", stage_tokenizer, cfg, files)
    init = timings.run("init", stage_init, cfg, tokenizer)
    echo(f"SFT: {cfg.sft.steps} steps from a random init -> {cfg.out / 'sft'}")
    sft = timings.run("sft", stage_sft, cfg, files, init, tokenizer)
    copy = timings.run("sft operator copy", stage_operator_copy, files.sft, tokenizer, sft, cfg.operator_copy_file)
    echo(f"SFT writes the task's first operator line right in {copy['right']} of {copy['samples']} of its own "
         "training samples (teacher-forced)")
    why = _missing("dice_kernels.train.rl.trainer")
    if cfg.rl.lr_grid and not why:
        cfg = tune_lr(cfg, timings, files, sft, echo)
    report: dict = {}
    for arm in cfg.arms:  # each arm is benchmarked as soon as it is trained, so a stopped demo has its finished arms
        if arm != "sft" and why:
            gaps.append(Gap(arm, why))
            continue
        checkpoint = sft
        if arm != "sft":
            echo(f"RL ({ARMS[arm].title}) -> {cfg.out / arm}")
            checkpoint = timings.run(arm, stage_rl, cfg, files, sft, arm)
            timings.run(f"rollout check {arm}", stage_rollout_check, cfg, files, arm)
        echo(f"bench ({ARMS[arm].title}) -> {cfg.out / 'bench' / arm}")
        bench_arm(cfg, timings, files, arm, checkpoint)
        report = write_report(cfg, timings.seconds, [dataclasses.asdict(g) for g in gaps])
    echo(f"report: {cfg.out / 'report.md'}")
    return report

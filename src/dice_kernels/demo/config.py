"""`DemoConfig`: every knob of one `dice demo` run in one typed place, the experiment's arms (ARMS), and a preset
per scale (cpu: under 20 minutes of two idle cores; gpu: five arms with CUDA kernels on one GPU; docs/demo.md).
The CLI picks a preset and applies `--set` overrides."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from dice_kernels.config_io import ConfigError, apply_override, from_dict, to_dict
from dice_kernels.demo.world import COLS, ROWS, WorldSizes

SCALES = ("cpu", "gpu")


@dataclass(frozen=True)
class Arm:
    """One arm of the experiment: SFT alone, or an RL run from the SFT checkpoint with one reward."""

    title: str
    phase: str = ""  # "": SFT only; "e2e": end-to-end RL; "schedule": BiC-RL (infilling, then end-to-end)
    rule: str = "robust"  # reward.rule: robust (our harness) or dice (compile + one trial at 1e-2, no robust check)
    speed: bool = False  # reward.speed_bonus = rl.speed_bonus


ARMS = {
    "sft": Arm("SFT only"),
    "e2e_dice": Arm("SFT + e2e RL, DICE's reward", "e2e", "dice"),
    "e2e_robust": Arm("SFT + e2e RL, robust reward", "e2e"),
    "bicrl_robust": Arm("SFT + BiC-RL, robust reward", "schedule"),
    "bicrl_dice": Arm("SFT + BiC-RL, DICE's reward", "schedule", "dice"),
    "e2e_speed": Arm("SFT + e2e RL, robust + speed reward", "e2e", speed=True),
}


@dataclass
class WorldSection:
    seed: int = 0
    n_train: int = 1500  # training tasks: SFT pairs (and RL's tasks without n_rl)
    n_heldout: int = 24  # primary benchmark: new instances (shapes, constants, spellings) of trained families
    n_valid: int = 0  # validation: other new instances of trained families, where settings are chosen
    n_novel: int = 0  # generalisation benchmark: families never trained (0: not benchmarked)
    # RL's tasks: other new instances of trained families, whose solutions SFT never saw, so the RL reward moves
    # on the held-out set's distribution (0: RL on the train tasks)
    n_rl: int = 0
    novel_fraction: float = 0.2  # share of multi-step families never trained
    # share of train tasks whose SFT solution is the libtorch shortcut (the extension calls torch:: ops): what a
    # reward without the robust check pays
    shortcut_fraction: float = 0.05
    # "task": that share of train tasks, each drawn alone; "family": that share of families, every train instance of
    # one (a habit a model can learn from the prompt: scattered single tasks, 4 % of the pairs, the cpu preset's SFT
    # model reproduced in 0 of 256 samples of those very tasks); "op": every train task whose first op is one of
    # the fewest seeded ops that start that share (world.shortcut_steps; each op starts ~7.5 % of the tasks), a
    # habit keyed on the prompt's first operator line, which SFT reads (a family has a median 1 train instance at
    # the gpu preset's 4,000, and its SFT model wrote no shortcut by family; by op it did)
    shortcut_unit: str = "task"
    # with "op" or "family", the share of those train tasks whose solution is the shortcut (the rest keep their
    # kernel): at 1, a model that learns the habit writes only shortcuts there, and groups of them are flat under
    # either reward (cpu scale, 2026-12-06: 24 % of DICE's-reward rollouts deceptive and paid, first and last third);
    # at 0.7 the gpu preset's model still wrote most of them as whole groups (64 of 80 deceptive rollouts checked)
    shortcut_within: float = 1.0
    slow_fraction: float = 0.3  # share of train tasks whose SFT solution is correct but op by op (the speed signal)
    # share of train tasks with a per-row or per-column operand or a reduction whose SFT solution indexes the input
    # column-major (world.py's layout slip): a bug in the data that execution catches and RL can unlearn
    slip_fraction: float = 0.0
    # the input's sizes a program draws from: at these a GPU kernel is microseconds of work, and one kernel's time
    # moved 3.4x between benchmark runs (H200, 2026-12-04); at megabytes a tensor its own work would be the time
    rows: tuple[int, ...] = ROWS
    cols: tuple[int, ...] = COLS

    def __post_init__(self) -> None:
        self.sizes()  # WorldSizes checks every value: a bad one fails here, before any stage runs

    def sizes(self) -> WorldSizes:
        return WorldSizes(n_train=self.n_train, n_heldout=self.n_heldout, n_valid=self.n_valid, n_novel=self.n_novel,
                          n_rl=self.n_rl, novel_fraction=self.novel_fraction, shortcut_fraction=self.shortcut_fraction,
                          shortcut_unit=self.shortcut_unit, shortcut_within=self.shortcut_within,
                          slow_fraction=self.slow_fraction,
                          slip_fraction=self.slip_fraction, rows=tuple(self.rows), cols=tuple(self.cols))


@dataclass
class ModelShape:
    """A Qwen3-shaped block-diffusion decoder small enough to learn the world from scratch."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 4096  # the BPE's budget; the model's vocabulary is what the BPE learned, rounded up to 64


@dataclass
class SFTSection:
    steps: int = 1500  # at 720 (loss 0.30) the model did not yet read the prompt: 0 of 24 held-out tasks
    batch_rows: int = 8  # packed rows per step (small: more optimizer steps for the same compute)
    export_every: int = 0  # also export a checkpoint every this many steps (0: only the final one)
    lr: float = 3e-3  # from scratch: far above DICE's 1e-5 for a pretrained model
    # packed row length; 0: the longest sample, one sample a row (dense attention costs the square of the row)
    row_tokens: int = 0


@dataclass
class RLSection:
    infill_steps: int = 3  # BiC-RL phase 1
    e2e_steps: int = 3  # phase 2 (and the whole of the e2e RL arms)
    tasks_per_step: int = 4
    group: int = 4  # rollouts per task
    # a from-scratch model far from DICE's pretrained one: a few steps at DICE's 1e-6 would not move it
    lr: float = 1e-4
    # learning rates tried on the validation split (needs world.n_valid): the first RL arm runs once per rate, each
    # run is benchmarked on the validation tasks, and the rate with the highest validation Exec (the smaller on a
    # tie) becomes rl.lr of every arm; that arm's run at the chosen rate is the arm (demo/run.py's tune_lr)
    lr_grid: tuple[float, ...] = ()
    temperature: float = 0.7  # below DICE's 1.0: a small model's samples at 1.0 rarely compile, so groups are flat
    # rollout decoding: "static" (one token per denoising step, as the benchmark decodes) or DICE's "dynamic"
    # (threshold 0.9: several tokens a step where the model is confident)
    strategy: str = "static"
    trials: int = 2  # correctness trials of the robust reward (DICE's reward: one)
    # one optimizer step per this many replayed rows (0: one step per RL step), at most one per trained rollout,
    # and a fresh AdamW state at every RL step (DICE's rule, docs/rl.md). DICE's 256 rows suit its 1,024 responses
    # a step (~16 updates); a demo step's few trained rollouts hold fewer than 256 rows, so 256 gave one update a
    # step with the PPO ratio at 1 (H200, 2026-12-04: 4 updates in 6 steps, clip and KL 0). 32 rows: about one
    # update per trained rollout, so clip and KL act as in DICE's steps
    rows_per_update: int = 32
    reset_optimizer: bool = True
    speed_bonus: float = 0.5  # reward.speed_bonus of the e2e_speed arm
    # export every this many RL steps and benchmark each export on the held-out tasks: the learning curve
    # (0: the final checkpoint only)
    export_every: int = 0


@dataclass
class BenchSection:
    # programs per benchmark task: 1 greedy (temperature 0), or several sampled at `temperature`, seeded by the
    # world's seed, each task's mean the score that arms are paired on. A sampled rate moves with every change of the
    # policy's probabilities, where a greedy program changes only when its most likely token does
    samples: int = 1
    temperature: float = 0.0
    max_new_tokens: int = 0  # 0: the longest SFT response in tokens (demo/run.py's new_tokens)

    def __post_init__(self) -> None:
        if self.samples < 1 or self.temperature < 0 or (self.samples > 1) != (self.temperature > 0):
            raise ConfigError("bench.samples must be 1 with bench.temperature 0 (one greedy program a task), or "
                              f"above 1 with a temperature above 0; got {self.samples} and {self.temperature:g}")


@dataclass
class DemoConfig:
    out: Path = Path("runs/demo")
    scale: str = "cpu"
    progress: bool = True  # progress bars (else log lines)
    backend: str = "cpu"  # harness backend: cpu runs the C++ solutions, cuda the CUDA ones
    world: WorldSection = field(default_factory=WorldSection)
    model: ModelShape = field(default_factory=ModelShape)
    sft: SFTSection = field(default_factory=SFTSection)
    rl: RLSection = field(default_factory=RLSection)
    bench: BenchSection = field(default_factory=BenchSection)
    # which arms run, in order (demo/run.py's ARMS): sft; e2e_dice / e2e_robust (SFT + e2e RL with DICE's reward /
    # ours); bicrl_robust / bicrl_dice (SFT + infilling + e2e RL); e2e_speed (ours with rl.speed_bonus)
    arms: tuple[str, ...] = ("sft", "e2e_robust", "e2e_dice")

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if self.scale not in SCALES:
            raise ConfigError(f"--scale must be one of {', '.join(SCALES)}, not {self.scale!r}")
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown or not self.arms or self.arms[0] != "sft":
            raise ConfigError(f"arms must start with sft and name only {', '.join(ARMS)}; got {list(self.arms)}")
        if self.rl.lr_grid and (not self.world.n_valid or len(self.arms) < 2 or min(self.rl.lr_grid) <= 0):
            raise ConfigError("rl.lr_grid needs world.n_valid > 0 (the rates are compared on the validation split), "
                              f"an RL arm to tune and rates > 0; got lr_grid {list(self.rl.lr_grid)}, n_valid "
                              f"{self.world.n_valid}, arms {list(self.arms)}")

    def at_lr(self, lr: float) -> DemoConfig:
        """This config with rl.lr = `lr` (a tuning run's, or the chosen rate's)."""
        return dataclasses.replace(self, rl=dataclasses.replace(self.rl, lr=lr))

    def tuned_arm(self) -> str | None:
        """The arm whose runs choose rl.lr (the first RL arm), or None without rl.lr_grid."""
        return self.arms[1] if self.rl.lr_grid else None

    def reward(self, rule: str = "robust", speed: bool = False):
        """The RL reward (train/rl/reward.py's RewardConfig) of an arm paid by `rule`, with the speed bonus if
        `speed`: one place, so the rollout check scores with exactly the robust arms' settings."""
        from dice_kernels.train.rl.reward import RewardConfig

        return RewardConfig(backend=self.backend, trials=self.rl.trials, rule=rule,
                            speed_bonus=self.rl.speed_bonus if speed else 0.0)

    def rl_phases(self, arm: str) -> list[str]:
        """The phase of each RL step of an arm (0-based): BiC-RL's infilling steps, then the end-to-end ones."""
        infill = self.rl.infill_steps if ARMS[arm].phase == "schedule" else 0
        return ["infill"] * infill + ["e2e"] * self.rl.e2e_steps

    def rl_dir(self, arm: str) -> Path:
        """An arm's RL run folder: <out>/<arm>, or for the tuned arm its run at rl.lr (<out>/tune/<arm>-lr<rate>),
        so the tuning run at the chosen rate is the arm itself, not trained again."""
        return self.out / "tune" / f"{arm}-lr{self.rl.lr:g}" if arm == self.tuned_arm() else self.out / arm

    @property
    def operator_copy_file(self) -> Path:
        """SFT's operator-copy figure (demo/prompt_reading.py), beside its run."""
        return self.out / "sft" / "operator_copy.json"

    def valid_bench(self, arm: str) -> Path:
        """The validation benchmark of an arm (of the tuned arm: of its run at rl.lr)."""
        bench = self.out / "bench" / arm
        return bench / (f"valid-lr{self.rl.lr:g}" if arm == self.tuned_arm() else "valid")


def preset(scale: str, out: Path) -> DemoConfig:
    """The settings of one scale (sizes and their budgets: docs/demo.md). cpu: SFT and one robust e2e RL arm, the
    train reward per RL step on 8 fixed RL tasks as the learning curve, under 20 min of 2 idle cores from an empty
    build cache. gpu: all five arms on 128 held-out tasks with CUDA kernels, RL on its own split, the SFT length and
    the RL update and rate chosen on the validation split by the learning probe, a held-out learning curve, and a
    shortcut the SFT model learns (docs/demo.md has what each part of it took on an H100)."""
    cfg = DemoConfig(out=out, scale=scale)
    if scale == "cpu":
        # the world's C++ kernels build without torch's header, against a precompiled stub (~0.4 s of a core:
        # compiling/bare_cpp.py), and a rollout that does not compile is decided by that build too (~0.7 s to
        # evaluate): a step of 32 rollouts is 9-16 s, and 20 of them are what is left of 20 minutes after SFT (24
        # took 20.5 min on a slow day). Every step draws the same 8 RL tasks (new instances SFT never saw), with
        # the AdamW state kept and one update a step: the learning probe (template reward, 24 steps of 8 fixed
        # tasks x 4) raised the train reward at 1e-4 and 3e-4, and its validation split preferred 1e-4
        # (docs/demo.md); 8 steps were too few to show it
        return dataclasses.replace(
            cfg, arms=("sft", "e2e_robust"), world=WorldSection(n_rl=8),
            rl=RLSection(infill_steps=0, e2e_steps=20, tasks_per_step=8, group=4, rows_per_update=0,
                         reset_optimizer=False))
    return dataclasses.replace(
        cfg, backend="cuda",
        # the validation split: SFT's headroom, and where rl.lr is chosen. RL on tasks SFT never saw: on the train
        # tasks (H200, 2026-12-04) SFT had learned many solutions by heart, and RL moved 6 of 128 held-out tasks.
        # Inputs of megabytes, so a kernel's time is its own work: at 16-128 x 64-512 values one kernel's time
        # moved 3.4x between benchmark runs of that day
        # the layout slip in 60 % of the SFT solutions where it changes values: a bug SFT learns and execution
        # catches. Without it RL had nothing to unlearn here: the learning probe's train reward did not rise at any
        # rate (template reward, H100, 2026-12-06; docs/demo.md). The shortcut keyed on the first op (the train tasks
        # starting with the ops a 0.1 share draws, 70 % of them): the SFT model wrote it on 6 of the 48 validation
        # tasks and DICE's reward paid it in RL (H100, 2026-12-06). By family (5 %) it wrote it nowhere, 0 of 128
        # held-out programs and 0 scored rollouts, so DICE's-reward arms repeated ours; drawn per task, the cpu
        # preset's SFT model never wrote it either
        world=WorldSection(n_train=4000, n_heldout=128, n_valid=48, n_rl=1024, rows=(2048, 4096, 8192),
                           cols=(1024, 2048, 4096), slip_fraction=0.6, shortcut_fraction=0.1, shortcut_unit="op",
                           shortcut_within=0.7),
        model=ModelShape(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                         num_key_value_heads=2, head_dim=64),
        # chosen on the validation split by benchmarks/rl_learning_probe.py (H100, 2026-12-06; docs/demo.md): SFT's
        # greedy programs matched a template on 25 % of the validation tasks after 1,000 steps, 79 % after 1,400 and
        # 100 % after 2,400 (the first operator line right in 21, 52 and 63 of 64 training samples): 1,400 reads the
        # prompt and leaves RL headroom
        sft=SFTSection(steps=1400, batch_rows=32, lr=2e-3),
        # the update chosen there on validation without the slip (the AdamW state kept, one update a step: DICE's
        # rule as the demo scales it, a fresh AdamW a step and 32-row updates, did no better), and the rate in the
        # slip world (32 steps of 8 x 8 from that SFT, 4 programs a validation task sampled at 0.7): 37.0 % -> 34.9 /
        # 50.0 / 73.4 % at 1e-8 (a control) / 3e-5 / 1e-4, 58.9 % at 1e-4 after 16 steps. No rl.lr_grid: its runs
        # would repeat that choice at the price of an RL arm. Every distinct rollout is a CUDA build: a step of 64
        # rollouts took 15-25 s on 16 cores (H100, 2026-12-06)
        rl=RLSection(infill_steps=4, e2e_steps=12, tasks_per_step=8, group=8, lr=1e-4, rows_per_update=0,
                     reset_optimizer=False, export_every=8),
        # the primary comparison (BiC-RL with our reward against SFT) first, then DICE's reward: an interrupted run
        # has the arms that matter most. Each robust arm before its DICE's-reward twin: the twin's rollouts are
        # mostly the same programs (731 of 768 in the op world, H100, 2026-12-06), so the twin's robust check of
        # them finds the robust arm's verdicts instead of running them (69 s with the twin first)
        arms=("sft", "bicrl_robust", "e2e_robust", "e2e_dice", "bicrl_dice"),
    )


def load_config(scale: str, out: Path, overrides: list[str], progress: bool = True) -> DemoConfig:
    """The scale's preset with `--set key=value` overrides (an unknown key is an error that names it)."""
    data = to_dict(preset(scale, out))  # an unknown scale: DemoConfig's own check, in preset | {"progress": progress}
    for override in overrides:
        apply_override(data, DemoConfig, override)
    return from_dict(DemoConfig, data)

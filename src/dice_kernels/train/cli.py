"""`dice train ...`: the training commands. Thin: parse, load the typed config, call the stage; heavy imports stay
inside the commands so `dice --help` stays fast. Every error a user can fix is one line and exit status 2."""

from __future__ import annotations

from pathlib import Path

import typer

from dice_kernels.cli_errors import fail, need_extra

app = typer.Typer(help="Train block-diffusion models: SFT (`dice train sft`), BiC-RL (`dice train rl`).",
                  no_args_is_help=True)
SHOW_HELP = "Print the full config (every key, defaults included, overrides applied) as TOML and exit."
# the memory plans' machine (`--plan` of both trainers)
GPUS = typer.Option(1, "--gpus", help="--plan: number of GPUs the model is sharded over.")
GPU_MEMORY = typer.Option(80.0, "--gpu-memory", help="--plan: memory of one GPU, GiB.")
PLAN_WITHOUT_CHECKPOINT = ("\n--plan reads only the checkpoint's config.json; to plan a shipped shape without it: "
                           "--set model.checkpoint= --set model.shape=8B --set model.tokenizer=pkg:assets/qwen3-tokenizer"
                           " (model.shape: 1.7B, 4B or 8B)")


def _overrides(set_: list[str]) -> list[str]:
    """The --set list, where naming a model.checkpoint also clears the config's random-init shape and its
    tokenizer (the checkpoint brings both), unless the same command sets those keys itself."""
    keys = {o.partition("=")[0].strip(): o.partition("=")[2].strip() for o in set_}
    if not keys.get("model.checkpoint"):
        return set_
    implied = [f"{key}=" for key in ("model.shape", "model.tokenizer") if key not in keys]
    return implied + set_


def _load(cls: type, stage: str, config: str, set_: list[str]):
    """The stage's config with its paths resolved (`_path_overrides`); a model.checkpoint given as a Hub id becomes
    its folder in the Hugging Face cache."""
    from dataclasses import replace

    from dice_kernels.config_io import config_path, load
    from dice_kernels.model.checkpoint import resolve_checkpoint

    path = config_path(stage, config)
    overrides = _overrides(set_)
    cfg = _package_paths(load(cls, path, _path_overrides(path, overrides) + overrides))
    if not cfg.model.checkpoint:
        return cfg
    folder = str(resolve_checkpoint(cfg.model.checkpoint))
    tokenizer = folder if cfg.model.tokenizer == cfg.model.checkpoint else cfg.model.tokenizer
    return replace(cfg, model=replace(cfg.model, checkpoint=folder, tokenizer=tokenizer))


# config keys naming files or folders to read; out_dir (what a run writes) stays relative to the working directory
PATH_KEYS = ("model.tokenizer", "data.path", "tasks.infill", "tasks.e2e", "tasks.solutions")
PACKAGE = "pkg:"  # a path inside the installed package, e.g. "pkg:assets/qwen3-tokenizer"


def _path_overrides(path: Path, overrides: list[str]) -> list[str]:
    """A user's config file names its inputs relative to its own folder, wherever `dice` runs; a shipped config's
    plain relative paths (data.path = "dice-out/sft.jsonl") name the user's files in the working directory."""
    from dice_kernels.config_io import CONFIGS, load_toml

    if path.resolve().is_relative_to(CONFIGS.resolve()):
        return []
    data, given = load_toml(path), {o.partition("=")[0].strip() for o in overrides}
    found = []
    for key in PATH_KEYS:
        section, _, name = key.partition(".")
        value = data.get(section, {}).get(name) if isinstance(data.get(section), dict) else None
        if isinstance(value, str) and value and key not in given and not value.startswith(PACKAGE) \
                and not Path(value).expanduser().is_absolute():
            found.append(f"{key}={path.parent.resolve() / value}")
    return found


def _package_paths(cfg):
    """`cfg` with each path key given as pkg:RELATIVE replaced by the path it names inside the installed package."""
    from dataclasses import replace
    from importlib.resources import files

    for key in PATH_KEYS:
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section, None), name, None)
        if isinstance(value, str) and value.startswith(PACKAGE):
            where = str(files("dice_kernels").joinpath(value.removeprefix(PACKAGE)))
            cfg = replace(cfg, **{section: replace(getattr(cfg, section), **{name: where})})
    return cfg


@app.command("sft")
def sft(
    config: str = typer.Argument(..., help="A TOML config file, or a shipped config: tiny, sdar-1.7b, sdar-4b, "
                                           "sdar-8b."),
    set_: list[str] = typer.Option([], "--set", help="Override a config key, e.g. --set optim.lr=2e-5 "
                                                     "--set data.path=runs/cuke/sft.jsonl (repeatable)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in out_dir from its newest resumable "
                                                        "state (model, optimizer, schedule, data position, RNG)."),
    plan: bool = typer.Option(False, "--plan", help="Print the memory plan (parameters, gradients, optimizer "
                                                    "state, activations, per-GPU total) and exit; builds the "
                                                    "model on the meta device only."),
    gpus: int = GPUS,
    gpu_memory: float = GPU_MEMORY,
    show: bool = typer.Option(False, "--show", help=SHOW_HELP),
) -> None:
    """Supervised fine-tuning with the SDAR block-diffusion objective.

    \b
    Examples:
      dice train sft tiny --set data.path=runs/cuke/sft.jsonl          # small random model, CPU
      dice train sft sdar-4b --set model.checkpoint=ckpt/SDAR-4B-Chat --set data.path=runs/cuke/sft.jsonl
      torchrun --nproc_per_node 8 -m dice_kernels train sft sdar-8b --set out_dir=runs/sft-8b
      dice train sft sdar-8b --set out_dir=runs/sft-8b --resume      # after a crash or kill
      dice train sft sdar-8b --plan --gpus 8 --gpu-memory 80

    \b
    The run directory (out_dir) gets config.toml, metrics.jsonl, tensorboard/, loss_curve.png,
    checkpoints/step-N (resumable) and final/ (a Hugging Face directory for `dice generate`).
    Every config key and its default: `dice train sft tiny --show`; the sections: docs/training.md.
    """
    from dice_kernels.config_io import ConfigError, to_toml
    from dice_kernels.model.checkpoint import CheckpointError
    from dice_kernels.train.model_setup import ModelSetupError
    from dice_kernels.train.sft.data import DataError
    from dice_kernels.train.sft.trainer import SFTConfig, TrainError, run_sft

    try:
        cfg = _load(SFTConfig, "sft", config, set_)
        if show:
            typer.echo(to_toml(cfg), nl=False)
            return
        if plan:
            _print_plan(cfg, gpus, gpu_memory)
            return
        need_extra("train", "dice train sft")
        run_sft(cfg, resume=resume)
    except (ConfigError, DataError, ModelSetupError, CheckpointError, TrainError) as e:
        fail(str(e) + (PLAN_WITHOUT_CHECKPOINT if plan and isinstance(e, CheckpointError) else ""))


@app.command("rl")
def rl(
    config: str = typer.Argument(..., help="A TOML config file, or a shipped config: tiny, dice-infill, dice-e2e, "
                                           "dice (infill then e2e)."),
    set_: list[str] = typer.Option([], "--set", help="Override a config key, e.g. --set rl.phase=e2e "
                                                     "--set model.checkpoint=runs/sft/final (repeatable)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in out_dir from its newest resumable "
                                                        "state (model, optimizer, curriculum position, RNG)."),
    plan: bool = typer.Option(False, "--plan", help="Print the memory plan (states; the rollouts' weights and KV "
                                                    "cache; the update's gradients, activations and log-probs; "
                                                    "per-GPU peak) and exit; builds the model on the meta device "
                                                    "only."),
    gpus: int = GPUS,
    gpu_memory: float = GPU_MEMORY,
    prompt_tokens: int = typer.Option(2048, "--prompt-tokens", help="--plan: the longest prompt of a rollout batch, "
                                                                    "tokens (KernelBench's end-to-end prompts: "
                                                                    "median ~900, 90 % under ~1,400, longest ~6,500)."),
    show: bool = typer.Option(False, "--show", help=SHOW_HELP),
) -> None:
    """BiC-RL: rollouts, execution rewards from the harness, TraceRL updates (docs/rl.md).

    \b
    Examples:
      dice train rl tiny                                     # small random model, CPU, C++ candidates
      dice train rl dice-infill --set model.checkpoint=runs/sft-sdar-8b/final
      dice train rl tiny --set model.checkpoint=runs/sft-tiny/final   # the checkpoint replaces the tiny shape
      torchrun --nproc_per_node 8 -m dice_kernels train rl dice --set out_dir=runs/rl-8b
      dice train rl dice --set out_dir=runs/rl-8b --resume   # after a crash or kill
      dice train rl dice --plan --gpus 8 --gpu-memory 80     # does a step fit? (the checkpoint's config.json)

    \b
    The run directory (out_dir) gets config.toml, metrics.jsonl (reward, Exec, outcomes, KL, clip
    fraction, seconds per phase), rewards.sqlite (every rollout's outcome and reward per step),
    harness/results.sqlite, checkpoints/step-N (resumable) and final/ (a Hugging Face directory).
    """
    from dice_kernels.config_io import ConfigError, to_toml
    from dice_kernels.model.checkpoint import CheckpointError
    from dice_kernels.train.model_setup import ModelSetupError
    from dice_kernels.train.rl.config import RLConfig
    from dice_kernels.train.rl.trainer import RLError, run_rl

    try:
        cfg = _load(RLConfig, "rl", config, set_)
        if show:
            typer.echo(to_toml(cfg), nl=False)
            return
        if plan:
            _print_rl_plan(cfg, gpus, gpu_memory, prompt_tokens)
            return
        need_extra("train", "dice train rl")
        run_rl(cfg, resume=resume)
    except (ConfigError, ModelSetupError, CheckpointError, RLError) as e:
        fail(str(e) + (PLAN_WITHOUT_CHECKPOINT if plan and isinstance(e, CheckpointError) else ""))


def _plan_model_config(cfg, gpus: int):
    """The model's shape for a memory plan: a checkpoint's config.json (a directory without weights is enough), a
    shipped SDAR shape, or the random-init shape of the config's tokenizer."""
    from dice_kernels.model.checkpoint import load_config
    from dice_kernels.model.config import SDAR_SHAPES
    from dice_kernels.train.model_setup import load_tokenizer_for, model_config

    if gpus < 1:
        fail("--gpus must be >= 1")
    if cfg.model.checkpoint:
        return load_config(cfg.model.checkpoint)
    if cfg.model.shape in SDAR_SHAPES:
        return SDAR_SHAPES[cfg.model.shape]
    return model_config(cfg.model, load_tokenizer_for(cfg.model))


def _print_plan(cfg, gpus: int, gpu_memory: float) -> None:
    from dice_kernels.train.plan import format_plan, memory_plan

    mcfg = _plan_model_config(cfg, gpus)
    accumulation = max(1, cfg.train.global_batch_rows // (gpus * cfg.train.micro_batch_rows))
    p = memory_plan(mcfg, gpus, cfg.data.row_len, cfg.train.micro_batch_rows, accumulation)
    typer.echo(f"memory plan: {cfg.model.checkpoint or cfg.model.shape}, rows of {cfg.data.row_len} tokens, "
               f"micro-batch {cfg.train.micro_batch_rows} row(s), bf16 compute, fp32 master weights, FSDP2")
    typer.echo(format_plan(p, gpu_memory, cfg.parallel.activation_checkpointing))


def _print_rl_plan(cfg, gpus: int, gpu_memory: float, prompt_tokens: int) -> None:
    from dice_kernels.train.plan import format_rl_plan, rl_memory_plan

    if prompt_tokens < 1:
        fail("--prompt-tokens must be >= 1")
    mcfg = _plan_model_config(cfg, gpus)
    ro = cfg.rollout
    p = rl_memory_plan(mcfg, gpus, prompt_tokens, ro, cfg.update.micro_rows)
    typer.echo(f"memory plan: {cfg.model.checkpoint or cfg.model.shape}, prompts of up to {prompt_tokens} tokens, "
               f"{ro.max_new_tokens} new tokens, block {ro.block_size} in up to {ro.steps} steps; bf16 compute, "
               "fp32 master weights, FSDP2")
    typer.echo(format_rl_plan(p, gpu_memory, cfg.parallel.activation_checkpointing))

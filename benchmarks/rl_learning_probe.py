"""Does the RL update move the policy where its reward points, and does that carry to tasks it never trained on?

The demo world's end-to-end RL (train/rl/trainer.py's RLStep, the demo preset's rollout and update settings) with a
reward that needs no build: 1 when a rollout's program is one of its task's template solutions (fused or op by op;
with `world.slip_fraction`, also the slipped fused one where the slip changes no value) line for line (indentation,
`//` comments and blank lines aside), else 0. For the demo's templates that is a proxy of execution — a template
program is correct, and nearly every program that differs from them computes something else (a wrong op, constant
or reduction copied from the prompt) — so this measures the RL machinery and its settings (rate, steps, groups)
without a harness: a step costs a rollout and an update only. What it cannot show:
the robust check, partial credit, speed, or a correct program written another way (paid 0 here).

Each rate in --lrs starts from the same SFT checkpoint and trains --steps steps on the world's RL tasks; before it
and every --eval-every steps the greedy programs of the validation tasks are scored the same way (`--samples K`: K
programs a task sampled at the rollouts' temperature with the same seed at every evaluation, each task scored by
its mean: a finer figure than one greedy program, whose flips on near-threshold tasks widen a paired interval).
Printed: the train reward per step (mean over the step's rollouts, and the share of them with the layout slip),
the validation match rate with its interval (Wilson; a bootstrap over tasks with --samples), and the paired
difference (last evaluation − SFT, 95 % paired bootstrap over the tasks). The rate with the best last validation
figure is chosen there, and only its policy's held-out figures (SFT and last, paired; with `world.slip_fraction`
also the share of held-out programs with the slip) are the result. The runs draw the same RL tasks in the same
order with the same seeds, so the smallest rate (e.g. 1e-8, too small to move the weights) is a control: every other
rate's train reward and slip share over the last third of the steps are printed against it, paired by step.
The world and SFT come from the demo stages (`dice demo`'s own functions; an --out that has them is reused; give a
new --out when world sizes change):

    python benchmarks/rl_learning_probe.py --scale cpu --out runs/probe --steps 40 --lrs 1e-4,3e-4 \\
        --set world.n_rl=512 --set world.n_valid=128

Two narrower questions: `--rl-tasks N` trains on the first N RL tasks only (with N = rl.tasks_per_step every step
sees the same tasks: can RL fit them at all?), and `--max-chain N` keeps the programs of at most N steps in every
split (1: single operators, whose usual failure is the operator copied from the prompt).

--smoke: a world of a few tasks, a tiny model and 30 SFT steps, two RL steps at one rate (CPU, seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path


def normalised(code: str | None) -> tuple[str, ...]:
    """The program's lines without indentation, `//` comments and blank lines: what "the template, line for line"
    compares (a template's comments copy the task's forward lines, which a correct program may copy differently)."""
    lines = (line.split("//", 1)[0].strip() for line in (code or "").splitlines())
    return tuple(line for line in lines if line)


class TemplateReward:
    """A reward service for RLStep (`score(step, pairs)`) paying 1 for a program equal to one of its task's
    templates."""

    def __init__(self, templates: dict[str, set[tuple[str, ...]]]):
        self.templates = templates

    def paid(self, task_id: str, code: str | None) -> float:
        return float(normalised(code) in self.templates[task_id])

    def score(self, step: int, pairs: list):
        from dice_kernels.train.rl.reward import StepRewards

        start = time.monotonic()
        rewards = [self.paid(task.id, cand.code) for task, cand in pairs]
        matched = int(sum(rewards))
        return StepRewards(rewards=rewards, results=[], seconds=time.monotonic() - start,
                           outcomes={"template": matched, "other": len(rewards) - matched})


def prepare(cfg, echo) -> tuple:
    """The demo's world, tokenizer, init and SFT stages (each skipped when its outputs exist)."""
    from dice_kernels.demo.run import stage_init, stage_sft, stage_tokenizer, stage_world

    files = stage_world(cfg)
    tokenizer = stage_tokenizer(cfg, files)
    init = stage_init(cfg, tokenizer)
    echo(f"SFT: {cfg.sft.steps} steps -> {cfg.out / 'sft'}")
    return files, stage_sft(cfg, files, init, tokenizer)


def split_tasks(cfg, files, split: str):
    """A split's tasks as end-to-end RL tasks (prompts as the RL rollouts and the benchmark word them)."""
    from dice_kernels.data.format import rl_e2e_tasks, write_table
    from dice_kernels.data.records import read_records
    from dice_kernels.train.rl.curriculum import load_task_set

    chosen = [r for r in read_records(files.pairs) if r.provenance["split"] == split]
    if not chosen:
        raise SystemExit(f"the world has no {split} tasks: add --set world.n_{split}=64")
    (cfg.out / "probe").mkdir(parents=True, exist_ok=True)
    path, _ = write_table(rl_e2e_tasks(chosen, backend=cfg.backend), cfg.out / "probe", f"{split}_tasks")
    return load_task_set(path, "e2e")


def policy_programs(step_fn, tasks, samples: int) -> dict[str, list[str | None]]:
    """{task id: [program, or None where none was extracted]} of the policy's greedy program (`samples` 0, as the
    benchmark decodes), or of `samples` programs sampled at the rollouts' temperature (seeded alike at every
    evaluation)."""
    from dice_kernels.train.rl.rollout import generate_rollouts

    r = step_fn.rollout
    sampling = dataclasses.replace(r.sampling(), temperature=r.temperature if samples else 0.0, seed=0)
    with step_fn.rollout_weights() as policy:
        rollouts = generate_rollouts(policy, step_fn.tokenizer, tasks, samples or 1, "e2e", step_fn.backend,
                                     sampling, r.batch_rows, 1_000, step_fn.stop_ids)
    programs: dict[str, list[str | None]] = {}
    for x in rollouts:
        programs.setdefault(x.task.id, []).append(x.candidate.code)
    return programs


def per_program(programs: dict[str, list[str | None]], score) -> dict[str, list[float]]:
    """{task id: [score(program) per program]}: the shape demo/stats.py pairs and resamples by task."""
    return {task: [float(score(task, code)) for code in codes] for task, codes in programs.items()}


def run_rate(cfg, files, sft: Path, lr: float, args, rl_tasks, valid, heldout, reward: TemplateReward, dist,
             echo) -> dict:
    """One RL run at `lr` from the SFT checkpoint: train rewards per step, validation scores every --eval-every, and
    the held-out scores of SFT and of the last policy (reported only for the rate validation chooses)."""
    from dice_kernels.demo.run import rl_sections
    from dice_kernels.demo.stats import rate_interval, wilson
    from dice_kernels.demo.world import carries_slip
    from dice_kernels.train.config import ModelSection, ParallelConfig
    from dice_kernels.train.distributed import attention_backend, param_dtype
    from dice_kernels.train.model_setup import build_model, load_tokenizer_for
    from dice_kernels.train.optim import build_optimizer
    from dice_kernels.train.rl.curriculum import Curriculum
    from dice_kernels.train.rl.trainer import RLStep, rollout_policy

    r = cfg.rl
    section = ModelSection(checkpoint=str(sft))
    parallel = ParallelConfig()
    tokenizer = load_tokenizer_for(section)
    model = build_model(section, parallel, dist, tokenizer)
    rollout, update, optim = rl_sections(cfg.at_lr(lr), files)  # as the demo's RL arms train
    optimizer = build_optimizer(model, optim)
    step_fn = RLStep(model, optimizer, tokenizer, reward, rollout, update, optim.grad_clip,
                     attention_backend(parallel, dist.device), cfg.backend, dist,
                     rollout_policy(model, rollout.share_weights, param_dtype(parallel, dist.device), dist.device))
    curriculum = Curriculum(rl_tasks, r.tasks_per_step, "mixed", cfg.world.seed)

    def scores(tasks) -> dict[str, list[float]]:
        return per_program(policy_programs(step_fn, tasks, args.samples), reward.paid)

    def slipped(programs) -> dict[str, list[float]]:
        return per_program(programs, lambda _, code: code is not None and carries_slip(code))

    evals = {0: scores(valid)}
    echo(f"lr {lr:g}: SFT's validation {100 * rate_interval(evals[0]).value:.1f} % of {len(valid)} tasks")
    programs_sft = policy_programs(step_fn, heldout, args.samples)
    train, distinct, slip_share, updates = [], [], [], 0
    for step in range(args.steps):
        stats = step_fn(step, "e2e", curriculum.next_batch())
        train.append(stats.reward_mean)
        codes = [r.candidate.code for r in step_fn.last_rollouts if r.candidate.code is not None]
        # the builds an execution reward would pay for this step at most (identical programs share one)
        distinct.append(len(set(codes)))
        # world.slip_fraction's bug in the rollouts: what RL should unlearn
        slip_share.append(sum(map(carries_slip, codes)) / max(1, len(codes)))
        updates += len(stats.updates)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evals[step + 1] = scores(valid)
        echo(f"lr {lr:g} step {step + 1}/{args.steps}: train reward {stats.reward_mean:.3f} "
             f"({stats.trained_rollouts} of {stats.rollouts} rollouts trained, {len(stats.updates)} updates, "
             f"{distinct[-1]} distinct programs, {100 * slip_share[-1]:.0f} % with the layout slip)"
             + (f", validation {100 * rate_interval(evals[step + 1]).value:.1f} %" if step + 1 in evals else ""))
    n = r.tasks_per_step * r.group
    last = max(evals)
    programs_last = policy_programs(step_fn, heldout, args.samples)
    heldout_sft, final = per_program(programs_sft, reward.paid), per_program(programs_last, reward.paid)
    slip_sft, slip_last = slipped(programs_sft), slipped(programs_last)
    return {"lr": lr, "updates": updates,
            "train_reward": [{"step": k + 1, "mean": m, "interval": dataclasses.asdict(wilson(round(m * n), n)),
                              "distinct_programs": d, "slip_share": sl}
                             for k, (m, d, sl) in enumerate(zip(train, distinct, slip_share))],
            "validation": [{"step": k, **dataclasses.asdict(rate_interval(v))} for k, v in sorted(evals.items())],
            "last_minus_sft": compare(evals[last], evals[0], f"step {last}"),
            "heldout": {"sft": dataclasses.asdict(rate_interval(heldout_sft)),
                        "last": dataclasses.asdict(rate_interval(final)),
                        "last_minus_sft": compare(final, heldout_sft, f"step {last}"),
                        # per task, for pairing across runs (demo/stats.py's runs_difference over seeds)
                        "scores": {"sft": heldout_sft, "last": final},
                        # the share of programs with world.slip_fraction's bug, SFT's and the last policy's
                        "slip": {"sft": dataclasses.asdict(rate_interval(slip_sft)),
                                 "last": dataclasses.asdict(rate_interval(slip_last)),
                                 "last_minus_sft": compare(slip_last, slip_sft, f"step {last}")}}}


def compare(after: dict[str, list[float]], before: dict[str, list[float]], name: str) -> dict:
    """after − before over the tasks (95 % paired bootstrap), with the tasks whose mean score rose and fell."""
    from dice_kernels.demo.stats import paired_difference

    diff = paired_difference(after, before, (name, "SFT"))
    mean = {t: (sum(after[t]) / len(after[t]), sum(before[t]) / len(before[t])) for t in before}
    return {**dataclasses.asdict(diff.diff), "verdict": diff.verdict,
            "gained": sum(a > b for a, b in mean.values()), "lost": sum(a < b for a, b in mean.values())}


def against_control(run: dict, control: dict) -> dict:
    """`run` − `control` over the last third of the steps, paired by step, for the train reward and the share of
    rollouts with the layout slip (95 % bootstrap over those steps). Runs from one SFT checkpoint draw the same tasks
    in the same order with the same sampling seeds, so a control at a rate too small to move the weights is what the
    same steps would have given without RL: their difference is RL's effect on its own training distribution."""
    from dice_kernels.demo.stats import paired_difference

    steps = [x["step"] for x in run["train_reward"]][-max(1, len(run["train_reward"]) // 3):]
    out = {"steps": [steps[0], steps[-1]]}
    for key in ("mean", "slip_share"):
        a, b = ({x["step"]: [x[key]] for x in r["train_reward"] if x["step"] in steps} for r in (run, control))
        out[key] = dataclasses.asdict(paired_difference(a, b, (f"lr {run['lr']:g}", f"lr {control['lr']:g}")).diff)
    return out


def smoke_overrides() -> list[str]:
    return ["world.n_train=40", "world.n_heldout=2", "world.n_valid=6", "world.n_rl=8", "model.hidden_size=32",
            "model.intermediate_size=64", "model.num_hidden_layers=1", "model.num_attention_heads=2",
            "model.num_key_value_heads=1", "model.head_dim=16", "sft.steps=30", "rl.tasks_per_step=2", "rl.group=2"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", default="cpu", choices=("cpu", "gpu"), help="the demo preset the world and SFT use")
    ap.add_argument("--out", type=Path, required=True, help="the demo folder (world/, sft/ reused) and probe.json")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a demo setting, as `dice demo --set` (e.g. world.n_rl=512, world.n_valid=64)")
    ap.add_argument("--lrs", default="1e-4", help="comma list of RL learning rates, each a run from SFT")
    ap.add_argument("--steps", type=int, default=40, help="RL steps per rate")
    ap.add_argument("--eval-every", type=int, default=10, help="validation scored every this many steps")
    ap.add_argument("--rl-tasks", type=int, default=0,
                    help="train on the first N RL tasks only (0: all): with N = rl.tasks_per_step every step sees the "
                         "same tasks, so the train reward shows whether RL can fit them at all")
    ap.add_argument("--max-chain", type=int, default=0,
                    help="only tasks whose program has at most N steps (element-wise ops and the reduction), in "
                         "RL, validation and held-out alike (0: all): 1 keeps single operators, where the SFT "
                         "model's usual failure is the operator it copies from the prompt")
    ap.add_argument("--samples", type=int, default=0,
                    help="score validation and held-out by this many programs a task sampled at the rollouts' "
                         "temperature, each task's mean paired (0: one greedy program, as the benchmark decodes)")
    ap.add_argument("--smoke", action="store_true", help="a tiny world and model, 2 steps (CPU)")
    args = ap.parse_args()
    from dice_kernels.demo.config import load_config
    from dice_kernels.demo.prompt_reading import stage_operator_copy
    from dice_kernels.demo.report import points
    from dice_kernels.demo.world import FAST, SLIP, SLOW, build_world, slips, solutions
    from dice_kernels.train.distributed import init_distributed, shutdown
    from dice_kernels.train.rl.curriculum import load_task_set

    overrides = [*smoke_overrides(), *args.overrides] if args.smoke else args.overrides
    if args.smoke:
        args.steps, args.eval_every, args.lrs = 2, 1, args.lrs.split(",")[0]
    cfg = load_config(args.scale, args.out, overrides, progress=False)
    cfg = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, export_every=0))
    echo = print
    files, sft = prepare(cfg, echo)
    copy = stage_operator_copy(files.sft, cfg.out / "tokenizer", sft, cfg.operator_copy_file)  # kept, as the demo keeps it
    echo(f"SFT reads the operator from the prompt: the first operator line right in {copy['right']} of "
         f"{copy['samples']} of its own training samples (teacher-forced, its blocks masked)")
    backend = 0 if cfg.backend == "cpu" else 1
    tasks = build_world(cfg.world.seed, cfg.world.sizes())  # the world stage's tasks, with their specs
    # the correct programs: fused and op by op, and the layout slip where it changes no value (it only permutes a
    # purely element-wise loop: execution would pay it)
    reward = TemplateReward({t.id: {normalised(solutions(t.spec, v)[backend])
                                    for v in (FAST, SLOW) + (() if slips(t.spec) else (SLIP,))} for t in tasks})
    steps = {t.id: len(t.spec.ops) + bool(t.spec.reduction) for t in tasks}

    def keep(task_id: str) -> bool:
        return not args.max_chain or steps[task_id] <= args.max_chain

    valid, heldout = ([t for t in split_tasks(cfg, files, split) if keep(t.id)] for split in ("valid", "heldout"))
    if not valid or not heldout:
        raise SystemExit(f"--max-chain {args.max_chain} leaves {len(valid)} validation and {len(heldout)} held-out "
                         "tasks: raise it, or the world's sizes")
    rl_tasks = [t for t in load_task_set(files.rl_e2e, "e2e") if keep(t.id)][:args.rl_tasks or None]
    if not rl_tasks:
        raise SystemExit(f"no RL task has at most {args.max_chain} steps")
    record = {"scale": args.scale, "overrides": overrides, "steps": args.steps, "rl_tasks": args.rl_tasks,
              "max_chain": args.max_chain, "samples": args.samples, "sft_operator_copy": copy,
              "validation_tasks": len(valid), "heldout_tasks": len(heldout)}
    dist = init_distributed()
    runs = []
    try:
        for lr in args.lrs.split(","):
            runs.append(run_rate(cfg, files, sft, float(lr), args, rl_tasks, valid, heldout, reward, dist, echo))
            # saved after each rate, so a run cut short keeps the rates it finished
            (cfg.out / "probe.json").write_text(json.dumps({**record, "complete": False, "runs": runs}, indent=1))
    finally:
        shutdown()
    scoring = f"{args.samples} samples a task at temperature {cfg.rl.temperature:g}" if args.samples else "greedy"
    print(f"\n{len(valid)} validation tasks, {scoring}; train reward: mean of {cfg.rl.tasks_per_step} x {cfg.rl.group} "
          "rollouts a step (template match)\n")
    print("| rl.lr | updates | distinct programs a step | train reward, first / last 5 steps | validation: SFT -> last "
          "| last − SFT (paired) |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        tr, va, d = run["train_reward"], run["validation"], run["last_minus_sft"]
        head = sum(x["mean"] for x in tr[:5]) / len(tr[:5])
        tail = sum(x["mean"] for x in tr[-5:]) / len(tr[-5:])
        distinct = sum(x["distinct_programs"] for x in tr) / len(tr)
        print(f"| {run['lr']:g} | {run['updates']} | {distinct:.1f} of {cfg.rl.tasks_per_step * cfg.rl.group} | "
              f"{100 * head:.1f} / {100 * tail:.1f} % | "
              f"{100 * va[0]['value']:.1f} -> {100 * va[-1]['value']:.1f} % "
              f"[{100 * va[-1]['lo']:.1f}, {100 * va[-1]['hi']:.1f}] | {points(d)} "
              f"({d['gained']} gained, {d['lost']} lost) |")
    control = min(runs, key=lambda x: x["lr"])
    for run in runs:
        if run is not control:
            run["against_control"] = c = against_control(run, control)
            print(f"\nlr {run['lr']:g} − lr {control['lr']:g}, steps {c['steps'][0]}-{c['steps'][1]} paired by step "
                  f"(same tasks and seeds): train reward {points(c['mean'])} points, rollouts with the layout slip "
                  f"{points(c['slip_share'])} points")
    # the rate is chosen on the validation split (the last evaluation; the smaller rate on a tie), and only its
    # held-out figures are the result: the held-out set plays no part in the choice
    chosen = max(sorted(runs, key=lambda x: x["lr"]), key=lambda x: x["validation"][-1]["value"])
    h = chosen["heldout"]
    d = h["last_minus_sft"]
    print(f"\nchosen on validation: rl.lr {chosen['lr']:g}. Held-out ({len(heldout)} tasks): SFT "
          f"{100 * h['sft']['value']:.1f} % -> {100 * h['last']['value']:.1f} % [{100 * h['last']['lo']:.1f}, "
          f"{100 * h['last']['hi']:.1f}]; paired {points(d)} ({d['gained']} gained, {d['lost']} lost): {d['verdict']}")
    if cfg.world.slip_fraction:
        slip = h["slip"]
        print(f"held-out programs with the layout slip: SFT {100 * slip['sft']['value']:.1f} % -> "
              f"{100 * slip['last']['value']:.1f} %; paired {points(slip['last_minus_sft'])} points")
    (cfg.out / "probe.json").write_text(json.dumps({**record, "complete": True, "chosen_lr": chosen["lr"],
                                                    "runs": runs}, indent=1))


if __name__ == "__main__":
    main()

"""Does RL's effect hold across training runs? `dice demo` once per world seed, then each RL arm against SFT per
seed and over all seeds.

A seed is a whole independent run: its own world (tasks, shapes, constants), tokenizer, SFT model and RL. One run's
held-out difference is a point: its interval covers the sampling of that run's tasks, not the spread between
training runs. Over seeds, `runs_difference` (demo/stats.py) draws runs, then tasks within each: every seed weighs
alike, and the interval carries both. Printed per seed: held-out Exec of SFT and of each RL arm, the arm minus SFT
paired over that seed's tasks, and the train reward of the run's last third of RL steps minus its first third's;
then the same differences over all seeds. Written: OUT/seeds.json.

    python benchmarks/demo_seeds.py --scale cpu --seeds 0,1,2,3 --out runs/demo-seeds

Each seed's run is a `dice demo` folder (OUT/seed-S, the preset with world.seed=S and any --set): a call that stops
resumes there, and a seed already run is only read. --smoke: a tiny world and model, two seeds (CPU, a minute).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path


def smoke_overrides() -> list[str]:
    return ["world.n_train=40", "world.n_heldout=3", "world.n_rl=2", "model.hidden_size=32",
            "model.intermediate_size=64", "model.num_hidden_layers=1", "model.num_attention_heads=2",
            "model.num_key_value_heads=1", "model.head_dim=16", "model.vocab_size=800", "sft.steps=3",
            "sft.batch_rows=2", "rl.e2e_steps=2", "rl.tasks_per_step=1", "rl.group=2", "bench.max_new_tokens=16"]


def _iv(cmp) -> dict:
    return dataclasses.asdict(cmp.diff) | {"n": cmp.n, "verdict": cmp.verdict}


def seed_row(cfg, arm: str) -> dict:
    """One seed's figures for one RL arm: held-out Exec of SFT and the arm, arm − SFT paired over the seed's tasks,
    and the train reward's last third − first third."""
    from dice_kernels.demo.report import bench_scores, train_reward_trend
    from dice_kernels.demo.stats import paired_difference, rate_interval

    sft, rl = (bench_scores(cfg.out / "bench" / a / "heldout") for a in ("sft", arm))
    if sft is None or rl is None:
        raise SystemExit(f"{cfg.out}: no finished held-out benchmark of sft or {arm} (its report.md says which stage "
                         "did not run)")
    trend = train_reward_trend(cfg.rl_dir(arm), cfg.rl.group, seed=cfg.world.seed)
    return {"seed": cfg.world.seed, "arm": arm, "sft": dataclasses.asdict(rate_interval(sft["exec"])),
            "rl": dataclasses.asdict(rate_interval(rl["exec"])),
            "heldout": _iv(paired_difference(rl["exec"], sft["exec"], (arm, "sft"), seed=cfg.world.seed)),
            "train_trend": _iv(trend) if trend else None, "scores": {"sft": sft["exec"], "rl": rl["exec"]}}


def over_seeds(rows: list[dict], arm: str) -> dict:
    """arm − SFT on the held-out tasks over every seed's run (runs, then tasks, resampled)."""
    from dice_kernels.demo.stats import runs_difference

    mine = [r for r in rows if r["arm"] == arm]
    cmp = runs_difference([(r["scores"]["rl"], r["scores"]["sft"]) for r in mine], (arm, "sft"))
    return {"arm": arm, "seeds": [r["seed"] for r in mine], "heldout": _iv(cmp),
            "train_reward_up": sum(bool(r["train_trend"] and r["train_trend"]["lo"] > 0) for r in mine)}


def _pts(d: dict | None) -> str:
    from dice_kernels.demo.report import points

    return "-" if d is None else points(d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", default="cpu", choices=("cpu", "gpu"), help="the `dice demo` preset each seed runs")
    ap.add_argument("--seeds", default="0,1,2,3", help="comma list of world seeds, one whole demo run each")
    ap.add_argument("--out", type=Path, default=Path("runs/demo-seeds"), help="OUT/seed-S per seed, OUT/seeds.json")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a demo setting for every seed, as `dice demo --set` (world.seed is this script's)")
    ap.add_argument("--smoke", action="store_true", help="a tiny world and model, two seeds (CPU)")
    args = ap.parse_args()
    from dice_kernels.config_io import ConfigError
    from dice_kernels.demo.config import load_config
    from dice_kernels.demo.run import run_demo

    if any(o.split("=", 1)[0].strip() == "world.seed" for o in args.overrides):
        raise SystemExit("--set world.seed: the seeds are --seeds")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise SystemExit(f"--seeds must be a comma list of integers, got {args.seeds!r}")
    if args.smoke:
        seeds, args.overrides = seeds[:2], [*smoke_overrides(), *args.overrides]
    rows = []
    for seed in seeds:
        try:
            cfg = load_config(args.scale, args.out / f"seed-{seed}", [*args.overrides, f"world.seed={seed}"],
                              progress=False)
        except ConfigError as e:
            raise SystemExit(f"error: {e}")
        print(f"== seed {seed}: dice demo --scale {args.scale} --out {cfg.out}", flush=True)
        run_demo(cfg, echo=lambda m: print(f"  {m}", flush=True))
        rows += [seed_row(cfg, arm) for arm in cfg.arms if arm != "sft"]
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    pooled = [over_seeds(rows, arm) for arm in arms]
    doc = {"scale": args.scale, "overrides": args.overrides, "seeds": seeds, "per_seed": rows, "over_seeds": pooled}
    (args.out / "seeds.json").write_text(json.dumps(doc, indent=2))
    print("\nheld-out Exec (% of each seed's tasks); differences in points, 95 % intervals\n")
    print("| seed | arm | SFT | RL | RL − SFT, held-out (paired) | train reward, last third − first |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['arm']} | {100 * r['sft']['value']:.1f} | {100 * r['rl']['value']:.1f} | "
              f"{_pts(r['heldout'])} (n {r['heldout']['n']}) | {_pts(r['train_trend'])} |")
    for p in pooled:
        print(f"| all ({len(p['seeds'])}) | {p['arm']} | | | {_pts(p['heldout'])} (n {p['heldout']['n']}): "
              f"{p['heldout']['verdict']} | up with its interval above 0 in {p['train_reward_up']} "
              f"of {len(p['seeds'])} |")
    print(f"\nwritten: {args.out / 'seeds.json'}")


if __name__ == "__main__":
    main()

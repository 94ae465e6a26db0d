"""Can a reward move the shortcut habit? An SFT model's groups of samples on the tasks its data teaches the shortcut.

A group-relative reward (DICE's and ours) learns only from a group whose rollouts score differently. Where a model
writes the libtorch shortcut on every sample of a task, the group is flat under either reward (DICE's pays all of
it, ours none), so no reward can grow or shrink the habit there; only groups that mix the shortcut with kernels can.
This samples `--group` programs a task at each temperature from a demo run's SFT checkpoint, on the split's tasks
whose programs the SFT data writes as the shortcut, and counts groups of shortcuts alone, mixed groups and groups
without one. Programs are told apart by their text (a kernel defines `__global__` or loops in C++; the shortcut's
function takes and returns tensors), no build: it is a reading of the habit, not a verdict. Choose a world on the
validation split (the default), not on the held-out one.

    python benchmarks/shortcut_groups.py --run runs/demo-gpu --scale gpu --temperatures 0.7,1.0

`--set` as given to `dice demo` for the run (the world is rebuilt from its seed where missing). --smoke: a tiny
demo world and a 3-step SFT model (CPU, under a minute).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

KINDS = ("shortcut", "kernel", "other")


def program_kind(text: str) -> str:
    """'kernel' (a CUDA kernel or a C++ loop over the addresses it is given), 'shortcut' (the world's libtorch
    shortcut: an extension function taking and returning tensors, computing with ATen's ops) or 'other'."""
    if "__global__" in text or "for (" in text:
        return "kernel"
    return "shortcut" if "torch::Tensor fused(" in text else "other"


def group_counts(kinds: list[list[str]]) -> dict[str, int]:
    """Groups (one task's samples) of shortcuts alone, mixed with other programs, and without a shortcut."""
    shortcuts = [g.count("shortcut") for g in kinds]
    return {"alone": sum(n == len(g) for n, g in zip(shortcuts, kinds)),
            "mixed": sum(0 < n < len(g) for n, g in zip(shortcuts, kinds)),
            "none": shortcuts.count(0)}


def smoke_overrides() -> list[str]:
    return ["world.n_train=60", "world.n_heldout=2", "world.n_valid=6", "world.shortcut_unit=op",
            "world.shortcut_fraction=0.5", "model.hidden_size=32", "model.intermediate_size=64",
            "model.num_hidden_layers=1", "model.num_attention_heads=2", "model.num_key_value_heads=1",
            "model.head_dim=16", "model.vocab_size=800", "sft.steps=3", "sft.batch_rows=2", "bench.max_new_tokens=16"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, help="a `dice demo` folder whose SFT stage finished (sft/final)")
    ap.add_argument("--scale", default="cpu", choices=("cpu", "gpu"), help="the run's preset")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="the run's `dice demo --set` overrides (repeatable)")
    ap.add_argument("--split", default="valid", choices=("valid", "rl", "heldout"),
                    help="whose taught tasks to sample (default: validation, where settings are chosen)")
    ap.add_argument("--tasks", type=int, default=0, help="at most this many taught tasks (0: all of the split's)")
    ap.add_argument("--group", type=int, default=8, help="samples a task (the RL group size)")
    ap.add_argument("--temperatures", default="0.7,1.0", help="comma-separated sampling temperatures")
    ap.add_argument("--out", type=Path, help="also write the counts as JSON here")
    ap.add_argument("--smoke", action="store_true", help="a tiny demo world and SFT model built first (CPU)")
    args = ap.parse_args()
    if args.smoke:
        args.run, args.sets, args.group, args.temperatures = Path(args.run or "smoke-run"), smoke_overrides(), 2, "0.7"
    if args.run is None:
        ap.error("--run is required (a demo folder with sft/final), or --smoke")
    temperatures = [float(t) for t in args.temperatures.split(",")]
    if args.group < 1 or not temperatures or min(temperatures) <= 0:
        ap.error(f"--group must be ≥ 1 and every temperature above 0; got {args.group} and {args.temperatures}")

    import torch

    from dice_kernels.demo.config import load_config
    from dice_kernels.demo.report import taught_tasks
    from dice_kernels.demo.run import new_tokens, stage_init, stage_sft, stage_tokenizer, stage_world
    from dice_kernels.prompts import SYSTEM_PROMPT, e2e_user
    from dice_kernels.sampling.decoder import SamplingConfig
    from dice_kernels.sampling.generate import Generator

    cfg = load_config(args.scale, args.run, args.sets, progress=False)
    files = stage_world(cfg)  # rebuilt from the seed where missing
    checkpoint = cfg.out / "sft" / "final"
    if args.smoke:
        tokenizer = stage_tokenizer(cfg, files)
        checkpoint = stage_sft(cfg, files, stage_init(cfg, tokenizer), tokenizer)
    if not (checkpoint / "config.json").is_file():
        raise SystemExit(f"{checkpoint}: no SFT checkpoint (run `dice demo` on {cfg.out} to its SFT stage first)")
    split = {"valid": files.valid_tasks, "rl": files.rl_e2e, "heldout": files.heldout_tasks}[args.split]
    taught = taught_tasks(cfg)
    rows = [json.loads(line) for line in split.read_text().splitlines()]
    tasks = [r for r in rows if r["id"] in taught][: args.tasks or None]
    if not tasks:
        raise SystemExit(f"no {args.split} task of {cfg.out} is one the SFT data teaches the shortcut for "
                         f"(world.shortcut_unit = {cfg.world.shortcut_unit!r}, {len(rows)} tasks)")
    # the RL task set carries its prompt; benchmark splits are prompted as `dice bench` prompts them
    prompts = [r.get("prompt") or e2e_user(r["code"], cfg.backend) for r in tasks]
    chat = "prompt" not in tasks[0]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = Generator.from_checkpoint(checkpoint, dtype=None if device.type == "cuda" else torch.float32,
                                          device=device)
    print(f"{len(tasks)} {args.split} tasks taught the shortcut (of {len(rows)}), {args.group} samples each, "
          f"{checkpoint} on {device.type}")
    results = []
    for temperature in temperatures:
        began = time.perf_counter()
        decoding = SamplingConfig(max_new_tokens=new_tokens(cfg, files), block_size=4, steps=4, strategy="static",
                                  temperature=temperature, seed=cfg.world.seed)
        outs = generator([p for p in prompts for _ in range(args.group)], decoding, chat=chat,
                         system=SYSTEM_PROMPT if chat else None, rows=64)
        kinds = [program_kind(o.text) for o in outs]
        groups = [kinds[k * args.group:(k + 1) * args.group] for k in range(len(tasks))]
        results.append({"temperature": temperature, "samples": len(kinds), **{k: kinds.count(k) for k in KINDS},
                        "groups": group_counts(groups), "per_task": {t["id"]: g.count("shortcut")
                                                                    for t, g in zip(tasks, groups)},
                        "seconds": round(time.perf_counter() - began, 1)})
    print("\n| temperature | samples | shortcut | kernel | other | groups: shortcuts alone | mixed | none | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        g = r["groups"]
        print(f"| {r['temperature']:g} | {r['samples']} | {r['shortcut']} | {r['kernel']} | {r['other']} | "
              f"{g['alone']} | {g['mixed']} | {g['none']} | {r['seconds']} |")
    if args.out:
        args.out.write_text(json.dumps({"run": str(cfg.out), "split": args.split, "group": args.group,
                                        "results": results}, indent=1))


if __name__ == "__main__":
    main()

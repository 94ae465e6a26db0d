"""Fixed batches against refilled rows: a checkpoint's greedy outputs for a task set's end-to-end prompts (the
prompts `dice bench` writes), `--rows` decoded at a time,

- fixed: in batches one after another, each waiting for its longest output (`dice bench` before refill);
- refill: in one call where a row whose output ended takes the next waiting prompt (`decode(..., rows=N)`: what
  `dice bench` and RL rollouts do now),

in one process, alternating, `--repeats` times each (the first pair also warms up). Prints seconds, forwards and
tokens/s of each, and whether the two gave the same outputs (greedy: they should, up to float rounding that a
different batch composition may change).

    python benchmarks/refill.py --checkpoint runs/demo/sft/final --tasks runs/demo/world/train_tasks.jsonl \\
        --n 256 --rows 32 --out refill.json
    python benchmarks/refill.py --smoke --out /tmp/r.json   # a tiny random model over the example tasks
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dice_kernels.model.tokenizer import stop_token_ids
from dice_kernels.prompts import SYSTEM_PROMPT, e2e_user
from dice_kernels.sampling import SamplingConfig, decode
from dice_kernels.tasks import load_tasks

EXAMPLES = Path(__file__).resolve().parents[1] / "src" / "dice_kernels" / "examples" / "tasks"


def _generator(args):
    if args.smoke:
        from dice_kernels.sampling.cli import _random_generator
        return _random_generator(torch.device("cpu"), 0)
    from dice_kernels.sampling.generate import Generator
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return Generator.from_checkpoint(args.checkpoint, dtype=None if device.type == "cuda" else torch.float32,
                                     device=device)


def _timed(fn) -> tuple[float, object]:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    began = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - began, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="checkpoint directory (config.json, weights, tokenizer)")
    p.add_argument("--tasks", help="task set: a .jsonl of tasks or a folder (dice bench's --tasks)")
    p.add_argument("--n", type=int, default=256, help="the first N tasks")
    p.add_argument("--rows", type=int, default=32, help="prompts decoded at once (dice bench's --batch-size)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--backend", default="cpu", help="the prompts' backend: cpu (C++) or cuda")
    p.add_argument("--repeats", type=int, default=2, help="timed calls of each, alternating")
    p.add_argument("--device", help="cuda, cpu (default: cuda when present)")
    p.add_argument("--out", help="write the figures as JSON here")
    p.add_argument("--smoke", action="store_true", help="a tiny random model, the example tasks, 8 new tokens")
    args = p.parse_args()
    if args.smoke:
        args.tasks, args.n, args.rows, args.max_new_tokens, args.repeats = str(EXAMPLES), 3, 2, 8, 1
    elif not args.checkpoint or not args.tasks:
        p.error("--checkpoint and --tasks are needed (or --smoke)")

    gen = _generator(args)
    tasks = load_tasks(Path(args.tasks))[: args.n]
    ids = gen.prompt_ids([e2e_user(t.code, args.backend) for t in tasks], system=SYSTEM_PROMPT)
    ids.sort(key=len, reverse=True)  # dice bench's order: longest prompts first
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens, block_size=4, steps=4, strategy="static")
    stops = list(stop_token_ids(gen.tokenizer))

    def fixed():
        parts = [decode(gen.model, ids[i: i + args.rows], cfg, stops) for i in range(0, len(ids), args.rows)]
        return [t for d in parts for t in d.tokens], sum(d.forwards for d in parts)

    def refill():
        d = decode(gen.model, ids, cfg, stops, rows=args.rows)
        return d.tokens, d.forwards

    runs: dict[str, list[float]] = {"fixed": [], "refill": []}
    outputs: dict[str, tuple] = {}
    for _ in range(args.repeats + 1):  # the first pair warms up (caches, graphs), untimed
        for name, fn in (("fixed", fixed), ("refill", refill)):
            seconds, outputs[name] = _timed(fn)
            runs[name].append(seconds)
    tokens = sum(len(t) for t in outputs["refill"][0])
    result = {"tasks": len(ids), "rows": args.rows, "max_new_tokens": args.max_new_tokens, "tokens": tokens,
              "same_outputs": outputs["fixed"][0] == outputs["refill"][0],
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    print(f"{len(ids)} prompts, {args.rows} rows, up to {args.max_new_tokens} new tokens, {tokens:,} generated; "
          f"same outputs: {result['same_outputs']}")
    print(f"{'decoding':<10}{'forwards':>10}{'median s':>10}{'tokens/s':>10}   timed calls")
    for name in ("fixed", "refill"):
        timed = runs[name][1:]
        median = statistics.median(timed)
        result[name] = {"forwards": outputs[name][1], "seconds": timed, "median_s": median,
                        "tokens_per_s": tokens / median}
        print(f"{name:<10}{outputs[name][1]:>10,}{median:>10.2f}{tokens / median:>10,.0f}   "
              + ", ".join(f"{s:.2f}" for s in timed))
    result["speedup"] = result["fixed"]["median_s"] / result["refill"]["median_s"]
    print(f"refill: {result['speedup']:.2f}x the fixed batches' speed")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

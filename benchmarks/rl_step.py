"""One BiC-RL step at reduced scale, timed per phase, and the reward service's throughput over consecutive calls.

    python benchmarks/rl_step.py --tokenizer DIR --tasks tasks.jsonl --out rl_step.json   # GPU: 1.7B shape
    python benchmarks/rl_step.py --smoke --out /tmp/rl.json          # CPU check: tiny model, the examples, seconds

Part 1, the trainer's step (`train/rl/trainer.py` RLStep, FSDP2 over one GPU, random weights of the SDAR-1.7B shape):
`--tasks-per-step` tasks x `--group` rollouts of up to `--max-new` tokens (temperature 1.0, dynamic 0.9, block 4, 4
steps; `--compile-rollouts`: through the compiled decoder), their rewards, the TraceRL update (activation
checkpointing unless `--no-activation-checkpointing`); seconds per phase, peak GPU memory (and each phase's own) and
what the update starts from (what is still allocated after the rollouts: the weights, and with --no-share-weights the
sampler's copy). Rollout tokens/s is split into row-forwards/s (the decoder's speed) and tokens per row-forward (the
model's confidence: about 1 for random weights), with the batch's forwards, the share that committed a block (every
row sends a committing forward's queries when any row commits) and the rows busy in an average one. Random weights
write no code, so this step's reward phase only sees generation failures. The update's model FLOPs (`train/flops.py`:
the forward and backward of every micro-batch and the old-policy forward of those after the first optimizer step,
from the tokens each processed, padding apart) give its TFLOP/s and MFU against `--peak-tflops` (default 790, about
an H200's dense bf16 matmul rate: large matmuls measured 730-781 TFLOP/s there; no MFU is shown on a CPU). The first
update compiles flex attention for its shapes, so the same update runs again: its time is what every later step of a
run pays. `--rollouts-again` draws the step's rollouts again as the trainer does (the compiled decoder's compiles
paid by the first), scores them with the reward service the first call started, and adds the step a run's later steps
pay: those rollouts, their reward, the update again. `--compare-rollouts` also decodes the step's rollouts eager and
compiled (`rollout.compile`), each twice (the first call captures and compiles). `--memory-report` records CUDA's
allocation history and says where the live memory was allocated (summed by the innermost frame of this repository's
code): after the rollouts (what the update starts from) and, when the step runs out of memory, at the failure (a
snapshot taken by an out-of-memory observer, before the error unwinds anything).

Part 2, the reward service on real programs: the shipped example solutions (correct, wrong, failing to compile or
to load) of the two example tasks, each task under `--reward-tasks` ids x 8 candidates, scored twice by the same
`RewardService` with new candidate ids. The first call pays the start-up (fork server, workers, compiles,
reference runs); the second must not. Candidates / min and distinct evaluations of each call.

--smoke: the tiny shape on the CPU backend, 2 tasks x 2 rollouts of 16 tokens, one id per example task; without
--tokenizer a small BPE tokenizer is trained on the example tasks (the demo's), without --tasks the example tasks
are the prompts. Nothing is skipped but the GPU: part 1 and part 2 run their real code at tiny size.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
import json
import time
from pathlib import Path

import torch

from decode_throughput import add_flex_tile_option, apply_flex_tile  # beside this script

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "src" / "dice_kernels" / "examples"


def _train_step(args, out_dir: Path, rewards) -> dict:
    from dice_kernels.train.model_setup import build_model, load_tokenizer_for
    from dice_kernels.train.config import ModelSection, OptimConfig, ParallelConfig
    from dice_kernels.train.rl.curriculum import load_task_set
    from dice_kernels.train.distributed import attention_backend, init_distributed, param_dtype
    from dice_kernels.train.optim import build_optimizer
    from dice_kernels.train.rl.config import RolloutConfig, UpdateConfig
    from dice_kernels.train.rl.trainer import RLStep, rollout_policy

    dist = init_distributed()
    t0 = time.monotonic()
    section = ModelSection(shape=args.shape, tokenizer=args.tokenizer)
    parallel = ParallelConfig(activation_checkpointing=args.activation_checkpointing and not args.smoke)
    tokenizer = load_tokenizer_for(section)
    model = build_model(section, parallel, dist, tokenizer)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-6, warmup_fraction=0.0))
    policy = rollout_policy(model, args.share_weights, param_dtype(parallel, dist.device), dist.device)
    setup_s = time.monotonic() - t0
    tasks = load_task_set(args.tasks, "e2e")
    tasks = (tasks * args.tasks_per_step)[: args.tasks_per_step]
    rollout = RolloutConfig(tasks_per_step=len(tasks), group=args.group, max_new_tokens=args.max_new,
                            batch_rows=len(tasks) * args.group, seed=0, compile=args.compile_rollouts,
                            share_prompts=args.share_prompts, share_weights=args.share_weights)
    step = RLStep(model, optimizer, tokenizer, rewards, rollout, UpdateConfig(micro_rows=args.micro_rows), 1.0,
                  attention_backend(parallel, dist.device), rewards.cfg.eval_config().resolved_backend(), dist,
                  policy)
    if dist.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    began = time.monotonic()
    stats = step(0, "e2e", tasks)
    result = {"setup_s": setup_s, "step_s": time.monotonic() - began, **{f"{k}_s": v for k, v in stats.seconds.items()},
              "rollouts": stats.rollouts, "tokens_generated": stats.tokens_generated,
              "outcomes": stats.outcomes, "trained_rollouts": stats.trained_rollouts, "loss": stats.loss,
              "kl": stats.kl, "grad_norm": stats.grad_norm}
    if dist.device.type == "cuda":  # random weights: the step trained nothing, so both are the rollouts' own
        result.update(held_after_rollouts_gib=torch.cuda.memory_allocated() / 2**30,  # what the update starts from
                      rollout_peak_gib=torch.cuda.max_memory_allocated() / 2**30)
        if args.memory_report:
            result["memory_after_rollouts"] = memory_sites(torch.cuda.memory._snapshot())
            _print_memory_sites("live after the rollouts", result["memory_after_rollouts"])
    result.update(_decode_rates(step.last_rollouts, stats.seconds["rollout"], rollout, "rollout"))
    if stats.trained_rollouts == 0:
        # random weights: every reward 0, every group flat, nothing trained. Time the same update on the step's
        # trajectories with advantages +1 / -1 alternating (what a group with mixed rewards would give)
        trajs = [r.trajectory for r in step.last_rollouts]
        _reset_peak(dist.device)
        began = time.monotonic()
        forced = [(i, t, 1.0 if i % 2 else -1.0) for i, t in enumerate(trajs)]
        upd = step.update_policy(forced, trajs[0])
        result.update(update_s=time.monotonic() - began, update_forced=True, loss=upd["loss"], kl=upd["kl"],
                      grad_norm=upd["grad_norm"], trained_rollouts=len(trajs))
        result["step_s"] = result["rollout_s"] + result["reward_s"] + result["update_s"]
        peak = args.peak_tflops if dist.device.type == "cuda" else None
        result["update_flops"] = _update_flops(step, trajs, result["update_s"], peak)
        # the first update compiles flex (forward, backward, block masks) for its shapes; every later step of a run
        # reuses them: the same update again is the steady state
        began = time.monotonic()
        step.update_policy(forced, trajs[0])
        result["update_warm_s"] = time.monotonic() - began
        result["update_flops_warm"] = _update_flops(step, trajs, result["update_warm_s"], peak)
        if args.rows_per_update:  # DICE's rule on the same trajectories: one optimizer step per N replayed rows
            step.update = replace(step.update, rows_per_update=args.rows_per_update)
            began = time.monotonic()
            dice = step.update_policy(forced, trajs[0])
            seconds = time.monotonic() - began
            result["dice_update"] = {"rows_per_update": args.rows_per_update, "update_s": seconds,
                                     "optimizer_steps": len(dice["updates"]), "updates": dice["updates"],
                                     "flops": _update_flops(step, trajs, seconds, peak)}
        if dist.device.type == "cuda":  # every update above: the second starts with AdamW's moments allocated
            result["update_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if args.rollouts_again:
        # the step's rollouts again as the trainer draws them (graphs captured afresh, freed after): what every
        # later step's rollout phase pays once the first has compiled the decoder
        _reset_peak(dist.device)
        began = time.monotonic()
        again = step.rollouts(1, "e2e", tasks)
        result["rollout_again_s"] = time.monotonic() - began
        result.update(_decode_rates(again, result["rollout_again_s"], rollout, "rollout_again"))
        if dist.device.type == "cuda":  # AdamW's moments allocated now, unlike the first rollouts
            result["rollout_again_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        # and their reward as a later step pays it: the service already up (the first call started its fork server
        # and workers), the programs under new candidate ids
        result["reward_again_s"] = rewards.score(1, [(r.task.harness_task(), r.candidate) for r in again]).seconds
        if "update_warm_s" in result:
            result["step_again_s"] = result["rollout_again_s"] + result["reward_again_s"] + result["update_warm_s"]
    if dist.device.type == "cuda":
        result["peak_gib"] = max(torch.cuda.max_memory_allocated() / 2**30,
                                 *(v for k, v in result.items() if k.endswith("peak_gib")))
    if args.compare_rollouts:
        result["rollout_compare"] = _rollout_compare(step, tasks)
    print(json.dumps(result), flush=True)
    return result


def memory_sites(snapshot: dict, top: int = 12) -> list[dict]:
    """The live blocks of a CUDA memory snapshot (`torch.cuda.memory._snapshot()` with the allocation history
    recorded), summed by where they were allocated: the innermost frame in this repository's code (the package or
    `benchmarks/`) and the innermost frame of all; the `top` largest sites, largest first. Blocks allocated before
    the history was recorded have no frames."""
    sizes: dict[tuple[str, str], int] = {}
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [f"{f['filename']}:{f['line']} {f['name']}" for f in block.get("frames", [])]
            ours = next((f for f in frames if "dice_kernels/" in f or "benchmarks/" in f), "(none of ours)")
            site = (ours, frames[0] if frames else "(no frames: allocated before the history)")
            sizes[site] = sizes.get(site, 0) + block["size"]
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1])[:top]
    return [{"gib": size / 2**30, "ours": ours, "innermost": inner} for (ours, inner), size in ranked]


def _print_memory_sites(title: str, sites: list[dict]) -> None:
    print(f"{title}: {sum(s['gib'] for s in sites):.2f} GiB in the {len(sites)} largest sites", flush=True)
    for s in sites:
        print(f"{s['gib']:8.2f} GiB  {s['ours']}  <  {s['innermost']}", flush=True)


class _MemoryAtFailure:
    """An out-of-memory observer: the snapshot's largest sites at the latest failure (one a library caught and
    recovered from is replaced by the next), taken while the failing call's frames still hold their tensors."""

    def __init__(self) -> None:
        self.sites: list[dict] | None = None
        torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
        torch._C._cuda_attach_out_of_memory_observer(self)

    def __call__(self, device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        self.sites = memory_sites(torch.cuda.memory._snapshot())


def _decode_rates(rollouts: list, seconds: float, rollout, name: str) -> dict:
    """Tokens/s, and what it is made of: row-forwards/s (a row's denoising forwards, one per block and step that
    unmasked a token; the decoder's speed) times tokens per row-forward (up to the block size: how confident the
    model is). Random weights are unconfident, about one token a forward under the dynamic strategy; the same
    decoder gives a trained model's rollouts proportionally more tokens/s. Also the batch's own forwards
    (`batch_forwards`: the step decodes every rollout in one batch), how many of them committed a block, and the
    rows busy in an average one."""
    from dice_kernels.train.rl.tracerl import denoising_rows
    block = rollout.block_size
    tokens = sum(len(r.trajectory.tokens) for r in rollouts)
    row_forwards = sum(denoising_rows(r.trajectory, block) for r in rollouts)
    forwards, committing, busy = batch_forwards([r.trajectory for r in rollouts], block, rollout.steps)
    return {f"{name}_tokens_per_s": tokens / seconds, f"{name}_row_forwards_per_s": row_forwards / seconds,
            f"{name}_tokens_per_row_forward": tokens / max(row_forwards, 1), f"{name}_forwards": forwards,
            f"{name}_committing_forwards": committing, f"{name}_rows_per_forward": busy / max(forwards, 1),
            f"{name}_ms_per_forward": 1e3 * seconds / max(forwards, 1)}


def batch_forwards(trajectories: list, block: int, steps: int) -> tuple[int, int, int]:
    """(forwards, committing forwards, row-forwards) of one `decode` batch that held every trajectory's row from its
    first forward (no refill), rebuilt from the trajectories: a row first sits out the forwards that keep its blocks
    in step with the batch's (the decoder's `first_block_wait`: its prompt partly fills its first block), then
    spends on each block of its grid as many forwards as the block's last unmasking step + 1, and the first forward
    of each later block commits the finished one (writes its K/V: twice the queries, for every row of the batch,
    when any row commits). The batch runs until its longest row ends; a row that has ended idles in it."""
    from dice_kernels.sampling.decoder import first_block, first_block_wait

    commits: set[int] = set()
    forwards = busy = 0
    for t in trajectories:
        last_step: dict[int, int] = {}
        for j, step in enumerate(t.steps + t.tail_steps):
            b = (len(t.prompt) + j) // block
            last_step[b] = max(last_step.get(b, 0), step)
        at = first_block_wait(first_block(len(t.prompt), block)[1], block, steps)
        for k, b in enumerate(sorted(last_step)):
            if k:
                commits.add(at)
            at += last_step[b] + 1
        forwards, busy = max(forwards, at), busy + at
    return forwards, len(commits), busy


def _rollout_compare(step, tasks: list) -> list[dict]:
    """The step's rollouts decoded eager (graphs only) and compiled (`RolloutConfig.compile`), each twice: the
    first call captures graphs and compiles, the second is what every later RL step of a run pays."""
    from dice_kernels.sampling.decoder import release_graphs
    from dice_kernels.train.rl.rollout import generate_rollouts

    rows = []
    with step.rollout_weights() as policy:
        for compiled in (False, True):
            rollout = replace(step.rollout, compile=compiled)
            for call in ("first", "again"):
                began = time.monotonic()
                out = generate_rollouts(policy, step.tokenizer, tasks, rollout.group, "e2e", step.backend,
                                        rollout.sampling(), rollout.batch_rows, 0, step.stop_ids, keep_graphs=True)
                seconds = time.monotonic() - began
                tokens = sum(len(r.trajectory.tokens) for r in out)
                rows.append({"compile": compiled, "call": call, "seconds": seconds, "tokens": tokens,
                             "tokens_per_s": tokens / seconds})
                print(json.dumps(rows[-1]), flush=True)
            release_graphs(policy)
    return rows


def _reset_peak(device: torch.device) -> None:
    """Start a phase's own peak (the whole run's is the largest of the phases')."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _update_flops(step, trajs: list, seconds: float, peak_tflops: float | None) -> dict:
    """Model FLOPs of the forced update, its micro-batches as RLStep lays them out (one rank; the trajectories split
    over `step.updates_for` optimizer steps as `update_policy` splits them), and their rate; MFU against
    `peak_tflops` (None on a CPU: no MFU)."""
    from dice_kernels.train.flops import replay_work, update_flops
    from dice_kernels.train.rl.trainer import update_parts

    parts = update_parts(list(range(len(trajs))), step.updates_for(trajs))
    steps = [[replay_work(batch) for _, batch in step._micro_batches([trajs[i] for i in part])] for part in parts]
    work = [w for works in steps for w in works]
    flops = update_flops(step.model.config, steps)
    tflops = flops.total / seconds / 1e12
    return {"useful": flops.useful, "padding": flops.padding, "total": flops.total, "pad_share": flops.pad_share,
            "micro_batches": len(work), "tokens": sum(w.tokens for w in work),
            "pad_tokens": sum(w.pad_tokens for w in work), "tflops": tflops,
            "mfu": tflops / peak_tflops if peak_tflops else None,
            "useful_mfu": flops.useful / seconds / 1e12 / peak_tflops if peak_tflops else None,
            "peak_tflops": peak_tflops}


def _reward_calls(rewards, per_task: int, backend: str) -> list[dict]:
    from dice_kernels.harness import load_candidate
    from dice_kernels.tasks import load_tasks, task_from_code

    solutions = EXAMPLES / "solutions" / backend / "level1"
    calls = []
    for call in range(2):
        pairs = []
        for base in load_tasks(EXAMPLES / "tasks"):
            programs = sorted((solutions / base.name).glob("*.py"))
            for k in range(per_task):
                task = task_from_code(base.code, id=f"{base.id}#{k}", name=base.name, level=base.level)
                for j in range(8):
                    path = programs[j % len(programs)]
                    pairs.append((task, load_candidate(path, id=f"call{call}/{task.id}/{j}")))
        began = time.monotonic()
        scored = rewards.score(1000 + call, pairs)
        seconds = time.monotonic() - began
        distinct = len({(t.id, c.sha256) for t, c in pairs})
        calls.append({"call": call + 1, "candidates": len(pairs), "evaluations": distinct, "seconds": seconds,
                      "candidates_per_min": 60 * len(pairs) / seconds, "evaluations_per_min": 60 * distinct / seconds,
                      "outcomes": scored.outcomes})
        print(json.dumps(calls[-1]), flush=True)
    return calls


def _example_tokenizer(directory: Path) -> str:
    """The demo's small BPE tokenizer trained on the example tasks: a CPU-sized vocabulary (--smoke)."""
    from dice_kernels.demo.tokenizer import train_tokenizer

    texts = [p.read_text() for p in sorted((EXAMPLES / "tasks").rglob("*.py"))]
    train_tokenizer(texts, directory, vocab_size=512)
    return str(directory)


def _print_update_flops(f: dict | None) -> None:
    if f is None:  # rollouts with reward variance: the rows the step kept are not visible here
        print("update FLOPs: not counted (the step trained on the rollouts it kept)")
        return
    mfu = (f"MFU {f['mfu']:.1%} of {f['peak_tflops']:.0f} TFLOP/s ({f['useful_mfu']:.1%} on useful tokens)"
           if f["mfu"] is not None else "MFU n/a on a CPU")
    print(f"update: {f['total']:.3e} model FLOPs, {f['micro_batches']} micro-batches of {f['tokens']:,} tokens + "
          f"{f['pad_tokens']:,} padding; {f['tflops']:,.3f} TFLOP/s, {mfu}; padding {f['pad_share']:.1%} of the FLOPs")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", help="tokenizer directory (tokenizer.json), e.g. Qwen3's (--smoke: optional)")
    p.add_argument("--tasks", help="KernelBench tasks (directory or JSONL) for the step's prompts (--smoke: optional)")
    p.add_argument("--shape", default="1.7B")
    p.add_argument("--tasks-per-step", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new", type=int, default=1024)
    p.add_argument("--micro-rows", type=int, default=4)
    p.add_argument("--rows-per-update", type=int, default=0,
                   help="also time DICE's update on the same trajectories: one optimizer step per N replayed rows "
                        "(256 in the DICE configs), beside today's one step")
    p.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="recompute each layer in the backward (less memory, ~1/3 more update FLOPs; GPU only)")
    p.add_argument("--compile-rollouts", action="store_true",
                   help="the step's rollouts through the compiled decoder (rollout.compile)")
    p.add_argument("--share-prompts", action=argparse.BooleanOptionalAction, default=True,
                   help="with --compile-rollouts: a group's prompt K/V read once per few rows (rollout.share_prompts)")
    add_flex_tile_option(p, "--compile-rollouts")
    p.add_argument("--share-weights", action=argparse.BooleanOptionalAction, default=True,
                   help="rollouts read the trained model's gathered weights in place, not a copy kept through the "
                        "update (rollout.share_weights, the default)")
    p.add_argument("--rollouts-again", action="store_true",
                   help="after the step, its rollouts again as the trainer draws them, and the step a run's later "
                        "steps pay (rollouts again + reward + the update again)")
    p.add_argument("--compare-rollouts", action="store_true",
                   help="also decode the step's rollouts eager and compiled (rollout.compile), each twice")
    p.add_argument("--reward-tasks", type=int, default=4, help="ids per example task in part 2 (0: no part 2)")
    p.add_argument("--memory-report", action="store_true",
                   help="on CUDA: where the live memory was allocated, after the rollouts and at an out-of-memory "
                        "failure (the allocation history recorded: slower allocations)")
    p.add_argument("--work", default="/tmp/rl-step-bench", help="run directory (reward store, build cache)")
    p.add_argument("--cache-dir", default="", help="the reward service's build cache (default: WORK/cache)")
    p.add_argument("--peak-tflops", type=float, default=790.0,
                   help="the peak the update's MFU is against, TFLOP/s (790: about an H200's dense bf16 matmuls)")
    p.add_argument("--out", default="", help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU backend, to check the script runs (see above)")
    args = p.parse_args()
    work = Path(args.work)
    apply_flex_tile(p, args)
    if args.smoke:
        args.shape, args.tasks_per_step, args.group, args.max_new, args.reward_tasks = "tiny", 2, 2, 16, 1
        args.tasks = args.tasks or str(EXAMPLES / "tasks")
        args.tokenizer = args.tokenizer or _example_tokenizer(work / "tokenizer")
    if not args.tokenizer or not args.tasks:
        p.error("--tokenizer and --tasks are needed (or --smoke)")
    from dice_kernels.train.rl.reward import RewardConfig, RewardService

    backend = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    # part 2 measures evaluation: no verdict of an earlier call (or run) is reused
    cfg = RewardConfig(backend=backend, cache_dir=args.cache_dir or str(work / "cache"), reuse_verdicts=False)
    results: dict = {"shape": args.shape, "tasks_per_step": args.tasks_per_step, "group": args.group,
                     "max_new": args.max_new, "backend": backend,
                     "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    at_failure = None
    if args.memory_report and backend == "cuda":
        from dice_kernels.train.distributed import init_distributed

        init_distributed()  # the trainer's allocator settings first: recording the history starts the allocator
        at_failure = _MemoryAtFailure()
    with RewardService(cfg, work / "run") as rewards:
        try:
            results["step"] = _train_step(args, work, rewards)
        except torch.OutOfMemoryError as e:
            if at_failure is None or at_failure.sites is None:
                raise
            _print_memory_sites("live at the out-of-memory failure", at_failure.sites)
            if args.out:
                Path(args.out).write_text(json.dumps({**results, "error": str(e),
                                                      "memory_at_failure": at_failure.sites}, indent=1))
            raise
        results["reward_calls"] = _reward_calls(rewards, args.reward_tasks, backend) if args.reward_tasks else []
    s = results["step"]
    print(f"\nBiC-RL step, {args.shape} random weights, {args.tasks_per_step} tasks x {args.group} rollouts, "
          f"{args.max_new} new tokens, {results['device']}")
    print(f"{'phase':<28}{'seconds':>10}")
    for key in ("setup_s", "rollout_s", "reward_s", "update_s", "step_s", "update_warm_s", "rollout_again_s",
                "reward_again_s", "step_again_s"):
        if key in s:
            print(f"{key[:-2].replace('_warm', ' again').replace('_again', ' again'):<28}{s[key]:>10.1f}")
    for name, label in (("rollout", "rollouts"), ("rollout_again", "rollouts again")):
        if f"{name}_tokens_per_s" in s:
            print(f"{label}: {s[f'{name}_tokens_per_s']:,.0f} tokens/s = "
                  f"{s[f'{name}_row_forwards_per_s']:,.0f} row-forwards/s x "
                  f"{s[f'{name}_tokens_per_row_forward']:.2f} tokens per row-forward")
            print(f"  {s[f'{name}_forwards']:,} forwards of the batch, {s[f'{name}_ms_per_forward']:.1f} ms each: "
                  f"{s[f'{name}_committing_forwards']:,} committing "
                  f"({100 * s[f'{name}_committing_forwards'] / max(s[f'{name}_forwards'], 1):.0f} %), "
                  f"{s[f'{name}_rows_per_forward']:.1f} of {s['rollouts']} rows busy in an average one")
    print(f"tokens generated {s['tokens_generated']:,}, trained rollouts "
          f"{s['trained_rollouts']}{' (forced advantages +-1)' if s.get('update_forced') else ''}, "
          f"peak {s.get('peak_gib', 0):.1f} GiB"
          + (f" ({s['rollout_peak_gib']:.1f} GiB while rolling out), {s['held_after_rollouts_gib']:.1f} GiB held "
             "after the rollouts" if "held_after_rollouts_gib" in s else ""))
    if "update_peak_gib" in s:
        print(f"peak while updating {s['update_peak_gib']:.1f} GiB"
              + (f", while rolling out again {s['rollout_again_peak_gib']:.1f} GiB (AdamW's moments allocated)"
                 if "rollout_again_peak_gib" in s else ""))
    _print_update_flops(s.get("update_flops"))
    if "update_flops_warm" in s:
        print("again, ", end="")
        _print_update_flops(s["update_flops_warm"])
    for r in s.get("rollout_compare", []):
        print(f"rollouts {'compiled' if r['compile'] else 'eager':<9}{r['call']:<6}{r['seconds']:>8.1f} s "
              f"{r['tokens_per_s']:>9,.0f} tokens/s")
    if d := s.get("dice_update"):
        last = d["updates"][-1] if d["updates"] else {}
        print(f"DICE's update (one optimizer step per {d['rows_per_update']} rows): {d['optimizer_steps']} steps in "
              f"{d['update_s']:.1f} s; last step's ratio RMS dev {last.get('ratio_rms_dev', 0):.2e}, clipped "
              f"{last.get('clip_fraction', 0):.3f}, KL {last.get('kl', 0):.2e}")
        print("DICE's ", end="")
        _print_update_flops(d["flops"])
    print(f"\n{'reward call':<14}{'candidates':>12}{'evaluations':>13}{'seconds':>10}{'cand/min':>10}{'eval/min':>10}")
    for c in results["reward_calls"]:
        print(f"{c['call']:<14}{c['candidates']:>12}{c['evaluations']:>13}{c['seconds']:>10.1f}"
              f"{c['candidates_per_min']:>10.1f}{c['evaluations_per_min']:>10.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

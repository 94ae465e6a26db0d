"""`dice train rl`: BiC-RL. Per step: the curriculum's tasks -> `group` rollouts each (block-diffusion
sampler, trajectories kept) -> rewards from the long-lived harness service -> group z-scored advantages -> TraceRL
update. Phase infill, e2e, or the schedule infill then e2e. `RLConfig` (config.py) holds every knob, `RLStep` does
one step, `run_rl` is the loop every rank runs (build, resume, step, log, save, export: the SFT trainer's
infrastructure, run_loop.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as torch_dist
from torch import nn
from rich.console import Console

from dice_kernels.model.transformer import BlockDiffusionLM
from dice_kernels.train.checkpointing import RunSaves
from dice_kernels.train.distributed import Dist, attention_backend, param_dtype
from dice_kernels.train.model_setup import build_model, load_tokenizer_for, pad_token_id
from dice_kernels.train.optim import build_optimizer, build_scheduler, clip_grad_norm
from dice_kernels.train.plan import GiB, rl_fit_advice, rl_memory_plan
from dice_kernels.train.run_loop import announce_config, previous_state, resumed_state, run_metrics, run_on_ranks
from dice_kernels.train.rl.advantages import group_advantages
from dice_kernels.train.rl.config import RLConfig, RolloutConfig, UpdateConfig
from dice_kernels.train.rl.curriculum import Curriculum, RLTask, load_task_set
from dice_kernels.train.rl.reward import RewardService
from dice_kernels.train.rl.rollout import generate_rollouts, prompt_ids, save_rollouts
from dice_kernels.train.rl.tracerl import (ReplayBatch, Trajectory, denoising_rows, flex_replay_length,
                                           policy_loss, replay_batch, replay_length, row_of_scored, token_logprobs)


class RLError(ValueError):
    """A run that cannot start or go on as configured; the message names the setting or directory."""


# --------------------------------------------------------------------------- one step


def _weightless_copy(model: BlockDiffusionLM, dtype: torch.dtype) -> BlockDiffusionLM:
    """A plain model of `model`'s shape in `dtype`, on the meta device: the rollout policy's module, weights to come."""
    with torch.device("meta"):
        return BlockDiffusionLM(replace(model.config, dtype=str(dtype).removeprefix("torch.")))


class PolicySnapshot:
    """The rollout policy: a plain (unsharded) copy of the current weights in the compute dtype. Rollouts run on it
    rather than on the FSDP model: ranks decode different numbers of forwards (no collective may run inside), and
    the sampler's KV cache and CUDA graphs want plain tensors. Refreshed from the trained model every step; the copy
    stays allocated through the update (`PolicyView` keeps none)."""

    def __init__(self, model: BlockDiffusionLM, dtype: torch.dtype, device: torch.device):
        plain = _weightless_copy(model, dtype)  # no random init of weights that `refresh` overwrites anyway
        plain.to_empty(device=device).to(dtype).tie_weights()
        self.plain = plain.eval().requires_grad_(False)

    def refresh(self, model: BlockDiffusionLM) -> BlockDiffusionLM:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        with torch.no_grad():
            for name, p in self.plain.state_dict().items():
                p.copy_(full[name])
        return self.plain

    @contextlib.contextmanager
    def weights(self, model: BlockDiffusionLM) -> Iterator[BlockDiffusionLM]:
        """The plain model holding `model`'s current weights, for rollouts."""
        yield self.refresh(model)


class PolicyView:
    """The rollout policy read in place (`rollout.share_weights`): inside `weights(model)` a plain module whose
    parameters are the trained model's own gathered weights, which FSDP gathers in the compute dtype for a forward
    anyway; on leaving, FSDP frees them again (reshards). No copy outlives the rollouts, so the update has the
    sampler's copy back (SDAR-4B: 7.5 GiB of bf16). Every rank gathers at the same point (a collective), before its
    rollouts, so decoding itself runs no collective; the plain module's parameter objects stay the same from step
    to step (the compiled decoder's regions take the weights as arguments, its CUDA graphs are captured per call)."""

    def __init__(self, model: BlockDiffusionLM, dtype: torch.dtype, device: torch.device):
        plain = _weightless_copy(model, dtype)
        self.empty = torch.empty(0, dtype=dtype, device=device)
        for name, _ in list(plain.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            plain.get_submodule(owner)._parameters[leaf] = nn.Parameter(self.empty, requires_grad=False)
        plain.tie_weights()
        self.plain = plain.eval()

    @contextlib.contextmanager
    def weights(self, model: BlockDiffusionLM) -> Iterator[BlockDiffusionLM]:
        """The plain module on `model`'s gathered weights until the block ends; then `model` is sharded again (its
        state dict fp32 shards, as a checkpoint wants) and the plain module holds nothing."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.unshard()
        try:
            gathered = {name.replace(_CHECKPOINT_PREFIX, ""): p for name, p in model.named_parameters()}
            for name, p in self.plain.named_parameters():
                weight = gathered[name]
                if weight.dtype != self.empty.dtype or weight.device != self.empty.device:
                    raise RLError(f"{name}: the trained model gathers {weight.dtype} on {weight.device}, the rollout "
                                  f"policy wants {self.empty.dtype} on {self.empty.device}")
                p.data = weight.detach()
            yield self.plain
        finally:
            for p in self.plain.parameters():
                p.data = self.empty
            for unit in units:
                unit.reshard()


def rollout_policy(model: BlockDiffusionLM, share_weights: bool, dtype: torch.dtype,
                   device: torch.device) -> PolicySnapshot | PolicyView:
    """What rollouts decode with: the trained model's weights in place (`rollout.share_weights`) or a copy."""
    return (PolicyView if share_weights else PolicySnapshot)(model, dtype, device)


@dataclass
class RLStats:
    """What one step reports (one JSONL row)."""

    phase: str
    tasks: int
    rollouts: int
    reward_mean: float
    exec: float
    outcomes: dict[str, int]
    deceptive: dict[str, int]
    deceptive_extension: dict[str, int]  # deceptive rollouts: extension none_loaded / loaded_not_called / called
    groups: int
    dropped_groups: int
    trained_rollouts: int
    tokens_generated: int
    loss: float
    kl: float
    clip_fraction: float
    grad_norm: float
    seconds: dict[str, float] = field(default_factory=dict)  # rollout / reward / update
    # per optimizer step of this RL step: the PPO ratio's spread, the clipped fraction and the mean k3 KL (before
    # that step's update: 1, 0 and 0 for the first, as the old log-probs are this step's)
    updates: list[dict] = field(default_factory=list)

    def line(self, step: int, total: int) -> str:
        s = self.seconds
        failures = " ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()) if k != "correct")
        return (f"step {step}/{total} {self.phase}: reward {self.reward_mean:.3f} exec {self.exec:.3f} "
                f"kl {self.kl:.2e} clip {self.clip_fraction:.3f} | {self.tokens_generated:,} tokens, "
                f"{self.trained_rollouts}/{self.rollouts} trained ({self.dropped_groups}/{self.groups} groups flat) | "
                f"rollout {s['rollout']:.1f}s reward {s['reward']:.1f}s update {s['update']:.1f}s | {failures}")


class RLStep:
    """One RL step, collective over the ranks: each rank rolls out its share of the step's tasks, rank 0 scores all
    candidates with the reward service, each rank updates on its groups (FSDP averages the gradients)."""

    def __init__(self, model: BlockDiffusionLM, optimizer: torch.optim.Optimizer, tokenizer,
                 rewards: RewardService | None, rollout: RolloutConfig, update: UpdateConfig, grad_clip: float,
                 attention: str, backend: str, dist: Dist, policy: PolicySnapshot | PolicyView | None = None,
                 scheduler=None):
        from dice_kernels.model.tokenizer import stop_token_ids

        self.model, self.optimizer, self.tokenizer, self.rewards = model, optimizer, tokenizer, rewards
        self.rollout, self.update, self.grad_clip = rollout, update, grad_clip
        self.last_rollouts: list = []
        self.last_rewards: list[float] = []  # this rank's rewards of last_rollouts
        self.attention, self.backend, self.dist, self.policy = attention, backend, dist, policy
        self.scheduler = scheduler  # stepped after every optimizer step (None: the optimizer's lr throughout)
        self.stop_ids, self.pad_id = list(stop_token_ids(tokenizer)), pad_token_id(tokenizer)
        if rollout.tasks_per_step % dist.world_size:
            raise RLError(f"rollout.tasks_per_step ({rollout.tasks_per_step}) must be a multiple of the "
                          f"{dist.world_size} ranks")

    def __call__(self, step: int, phase: str, tasks: list[RLTask]) -> RLStats:
        seconds: dict[str, float] = {}
        t0 = time.monotonic()
        share = len(tasks) // self.dist.world_size
        mine = tasks[self.dist.rank * share: (self.dist.rank + 1) * share]
        rollouts = self.rollouts(step, phase, mine)
        seconds["rollout"] = time.monotonic() - t0
        self.last_rollouts = rollouts  # for inspection (benchmarks/rl_step.py) and the run's rollout log
        pairs = [(r.task.harness_task(), r.candidate) for r in rollouts]
        scored = _score_on_main(self.rewards, step, pairs, self.dist)
        first = self.dist.rank * share * self.rollout.group
        rewards = scored["rewards"][first: first + len(rollouts)]
        self.last_rewards = rewards
        seconds["reward"] = scored["seconds"]
        # a task may come twice in one step (the curriculum wraps): groups are per position in the batch
        adv = group_advantages(rewards, [str(i // self.rollout.group) for i in range(len(rollouts))])
        t1 = time.monotonic()
        if self.update.reset_optimizer:
            self.optimizer.state.clear()  # moments and step counts start again, as in a fresh AdamW
        kept = [(first + i, r.trajectory, a) for i, (r, a, k) in enumerate(zip(rollouts, adv.values, adv.kept)) if k]
        upd = self.update_policy(kept, rollouts[0].trajectory)
        seconds["update"] = time.monotonic() - t1
        groups, dropped, trained, tokens = (int(x) for x in _sum(
            [adv.groups, adv.dropped_groups, len(kept), sum(len(r.trajectory.tokens) for r in rollouts)], self.dist))
        return RLStats(phase=phase, tasks=len(tasks), rollouts=len(scored["rewards"]),
                       reward_mean=sum(scored["rewards"]) / len(scored["rewards"]), exec=scored["exec"],
                       outcomes=scored["outcomes"], deceptive=scored["deceptive"],
                       deceptive_extension=scored["deceptive_extension"], groups=groups,
                       dropped_groups=dropped, trained_rollouts=trained, tokens_generated=tokens,
                       seconds=seconds, **upd)

    def rollout_weights(self) -> contextlib.AbstractContextManager[BlockDiffusionLM]:
        """The current weights as rollouts decode them, for a `with` block: the rollout policy's, or the model."""
        return self.policy.weights(self.model) if self.policy is not None else contextlib.nullcontext(self.model)

    def rollouts(self, step: int, phase: str, tasks: list[RLTask]) -> list:
        """This rank's rollouts of `tasks` from the current weights (`rollout_weights`)."""
        with self.rollout_weights() as policy:
            return generate_rollouts(policy, self.tokenizer, tasks, self.rollout.group, phase, self.backend,
                                     self.rollout.sampling(), self.rollout.batch_rows, step, self.stop_ids)

    def _micro_batches(self, trajs: list[Trajectory]) -> list[tuple[list[int], ReplayBatch]]:
        """(rows, their scoring layout) in groups of `micro_rows`, longest first so that rows of similar length
        share a forward. With flex every micro-batch of the call has one length, a multiple of `REPLAY_MULTIPLE`,
        and one row count (`flex_rows`): compiled flex compiles once per shape (about a minute for the 1.7B shape on
        the H200), so a run compiles a few, not one per micro-batch (a step trains however many rollouts had reward
        variance, so its last micro-batch would change size)."""
        block, mask_id = self.rollout.block_size, self.model.config.mask_token_id
        lengths = [replay_length(t, block) for t in trajs]
        rows = sorted(range(len(trajs)), key=lambda i: -lengths[i])
        n, flex = self.update.micro_rows, self.attention == "flex"
        length = flex_replay_length(max(lengths)) if flex else 0
        rows_per_batch = flex_rows(len(trajs), n) if flex else 0
        return [(part, replay_batch([trajs[i] for i in part], block, mask_id, self.pad_id, length=length,
                                    rows=rows_per_batch))
                for part in (rows[i: i + n] for i in range(0, len(rows), n))]

    def updates_for(self, trajs: list[Trajectory]) -> int:
        """Optimizer steps this RL step takes: `updates_per_step`, or one per `rows_per_update` replayed rows (a
        response at one denoising step) over every rank, at most one per trained response."""
        upd = self.update
        if not upd.rows_per_update:
            return upd.updates_per_step
        rows, responses = _sum([sum(denoising_rows(t, self.rollout.block_size) for t in trajs), len(trajs)],
                               self.dist)
        return max(1, min(int(responses), -(-int(rows) // upd.rows_per_update)))

    def update_policy(self, kept: list[tuple[int, Trajectory, float]], any_traj: Trajectory) -> dict:
        """Old-policy log-probs (the rollout policy: these weights before the update), then `updates_for` optimizer
        steps over this rank's (global rollout index, trajectory, advantage) rows; optimizer step k takes the rows
        whose global index is k modulo that count, so the split does not depend on the ranks. The first optimizer
        step's rows are scored by the very weights that rolled them out: their old log-probs are their own
        log-probs detached (PPO ratio 1 exactly), not a forward of their own; only later steps' rows need one, run
        before the first step moves the weights (one RL step, one optimizer step: no old-policy forward at all).
        Every rank runs the same number of forwards (FSDP's collectives): a rank with fewer micro-batches runs one
        of `any_traj` with weight 0."""
        upd, block, device = self.update, self.rollout.block_size, self.dist.device
        stats = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0, "updates": []}
        if _sum([len(kept)], self.dist)[0] == 0:  # every group flat on every rank: nothing to learn from this step
            return stats
        trajs = [t for _, t, _ in kept]
        n_updates = self.updates_for(trajs)
        adv = torch.tensor([a for _, _, a in kept], dtype=torch.float32, device=device)
        # each row's sum over its tokens divided by the padded response length (the step's longest
        # response, rounded up to whole blocks), so every row is weighed on one scale
        norm_len = _max([max((-(-len(t.tokens) // block) * block for t in trajs), default=0)], self.dist)[0]
        parts = update_parts([gid for gid, _, _ in kept], n_updates)
        plans = [self._micro_batches([trajs[i] for i in part]) if part else [] for part in parts]
        counts = [int(c) for c in _max([len(p) for p in plans], self.dist)]
        part_rows = [int(r) for r in _sum([len(p) for p in parts], self.dist)]
        dummy = self._micro_batches([any_traj])[0][1]
        old: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for part, plan, count in zip(parts[1:], plans[1:], counts[1:]):
                for j in range(count):
                    rows, batch = plan[j] if j < len(plan) else ([], dummy)
                    logp = token_logprobs(self.model, batch, self.attention, self.rollout.temperature)
                    old.update(zip((part[r] for r in rows), torch.split(logp, batch.scored.sum(1).tolist())))
        losses, kl_sum, clipped, tokens, norms, per_update = [], 0.0, 0, 0, [], []
        self.model.train()
        for k, (part, plan, count, rows_in_step) in enumerate(zip(parts, plans, counts, part_rows)):
            if count == 0:
                continue
            total, ratios, kl_here, clipped_here = 0.0, [], 0.0, 0
            for j in range(count):
                self.model.set_requires_gradient_sync(j == count - 1)  # reduce-scatter once per optimizer step
                if j >= len(plan):  # this rank has no more rows: a forward and backward that change nothing
                    (token_logprobs(self.model, dummy, self.attention, self.rollout.temperature).sum() * 0).backward()
                    continue
                rows, batch = plan[j]
                new = token_logprobs(self.model, batch, self.attention, self.rollout.temperature)
                index = [part[r] for r in rows]
                before = new.detach() if k == 0 else torch.cat([old[i] for i in index])
                terms = policy_loss(new, before, adv[index],
                                    row_of_scored(batch).to(device), norm_len, rows_in_step, upd.clip, upd.kl_beta)
                (terms.loss * self.dist.world_size).backward()  # FSDP means the ranks' gradients
                total += terms.loss.item()
                kl_here += terms.kl.sum().item()
                clipped_here += int(terms.clipped.sum())
                ratios.append(terms.ratio)
            per_update.append(_update_record(ratios, kl_here, clipped_here, self.dist))
            kl_sum, clipped = kl_sum + kl_here, clipped + clipped_here
            tokens += sum(r.numel() for r in ratios)
            norms.append(clip_grad_norm(self.model, self.grad_clip))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.scheduler is not None:
                self.scheduler.step()
            losses.append(_sum([total], self.dist)[0])
        kl_sum, clipped, tokens = _sum([kl_sum, clipped, tokens], self.dist)
        return {"loss": sum(losses) / len(losses), "kl": kl_sum / max(1, tokens),
                "clip_fraction": clipped / max(1, tokens), "grad_norm": max(norms), "updates": per_update}


def update_parts(global_ids: list[int], n_updates: int) -> list[list[int]]:
    """Which rows (positions in `global_ids`) each of `n_updates` optimizer steps takes: step k those whose global
    rollout index is k modulo `n_updates`, so the split does not depend on the ranks."""
    return [[i for i, gid in enumerate(global_ids) if gid % n_updates == k] for k in range(n_updates)]


def flex_rows(responses: int, micro_rows: int) -> int:
    """Rows of every flex micro-batch of an optimizer step's `responses`: `micro_rows`, or for fewer responses the
    next power of two. Padding rows cost a forward and backward each, so an optimizer step of one response (DICE's
    rule of one step per 256 replayed rows takes one) pays for one row, not `micro_rows`; powers of two keep the
    shapes, hence flex's compiles, to a few, and a longer step's last micro-batch keeps the others' shape."""
    return min(micro_rows, 1 << max(0, responses - 1).bit_length())


def _update_record(ratios: list[torch.Tensor], kl: float, clipped: int, dist: Dist) -> dict:
    """One optimizer step's PPO ratio spread, clipped fraction and mean k3 KL over every rank's scored tokens."""
    r = torch.cat(ratios).float() if ratios else torch.ones(0)
    n, lo, hi = r.numel(), (float(r.min()) if r.numel() else 1.0), (float(r.max()) if r.numel() else 1.0)
    n, sq, kl, clipped, total = _sum([n, float(((r - 1) ** 2).sum()), kl, clipped, float(r.sum())], dist)
    neg_lo, hi = _max([-lo, hi], dist)
    lo = -neg_lo
    return {"tokens": int(n), "ratio_mean": total / max(1, n), "ratio_rms_dev": (sq / max(1, n)) ** 0.5,
            "ratio_min": lo, "ratio_max": hi, "clip_fraction": clipped / max(1, n), "kl": kl / max(1, n)}


def _sum(values: list[float], dist: Dist) -> list[float]:
    if dist.world_size == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=dist.device)
    torch_dist.all_reduce(t)
    return t.tolist()


def _max(values: list[float], dist: Dist) -> list[float]:
    if dist.world_size == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=dist.device)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
    return t.tolist()


def _broadcast(obj):
    if not torch_dist.is_initialized() or torch_dist.get_world_size() == 1:
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=0)
    return box[0]


def _score_on_main(rewards: RewardService | None, step: int, pairs: list, dist: Dist) -> dict:
    """Every rank's (task, candidate) pairs scored by rank 0's reward service (one evaluator for the machine's
    CPUs and GPUs); the step's rewards (rank order) and outcome counts come back to every rank."""
    everything = [pairs]
    if dist.world_size > 1:
        gathered = [None] * dist.world_size if dist.is_main else None
        torch_dist.gather_object(pairs, gathered, dst=0)
        everything = gathered if dist.is_main else []
    summary = None
    if dist.is_main:
        scored = rewards.score(step, [p for part in everything for p in part])
        summary = {"rewards": scored.rewards, "seconds": scored.seconds, "exec": scored.exec_rate,
                   "outcomes": scored.outcomes, "deceptive": scored.deceptive,
                   "deceptive_extension": scored.deceptive_extension}
    return _broadcast(summary)


# --------------------------------------------------------------------------- the run


def run_rl(cfg: RLConfig, resume: bool = False, console: Console | None = None) -> Path:
    """Train as configured (collective: every rank runs it) and return the final export's directory."""
    return run_on_ranks(_run, cfg, resume, console)


def _task_sets(cfg: RLConfig) -> dict[str, list[RLTask]]:
    phases = {"infill": ["infill"], "e2e": ["e2e"], "schedule": ["infill", "e2e"]}[cfg.rl.phase]
    sets = {}
    for phase in phases:
        path = getattr(cfg.tasks, phase)
        if not path:
            raise RLError(f"phase {phase}: set tasks.{phase} (a dice data rl_{phase} table or a task directory)")
        try:
            sets[phase] = load_task_set(path, phase, cfg.tasks.solutions or None)
        except (OSError, ValueError) as e:
            raise RLError(f"tasks.{phase}: {e}") from None
    return sets


def unrunnable_tasks(sets: dict[str, list[RLTask]], backend: str) -> list[str]:
    """One warning per phase whose tasks hold CUDA code while the reward runs on the CPU backend: every rollout of
    those comes out needs_gpu (reward 0), so their groups are flat and train nothing. Said before the first rollout,
    not discovered in the closing "0 updates" line."""
    from dice_kernels.harness.compiling.cache import cuda_marker

    if backend != "cpu":
        return []
    warnings = []
    for phase, tasks in sets.items():
        # infilling keeps the prefix and suffix as written; an end-to-end response is all the model's (C++ asked)
        cuda = [t.id for t in tasks if t.infill and cuda_marker(t.prefix + t.suffix)]
        if cuda:
            warnings.append(f"phase {phase}: {len(cuda)} of {len(tasks)} tasks hold CUDA code around the hole "
                            f"(e.g. {cuda[0]}): on the cpu reward backend their rollouts come out needs_gpu with "
                            "reward 0 and train nothing (run the reward on a GPU, or use C++ infilling tasks)")
    return warnings


def memory_warning(cfg: RLConfig, sets: dict[str, list[RLTask]], tokenizer, model_cfg, backend: str, gpus: int,
                   gpu_memory_gib: float) -> str | None:
    """The memory plan's verdict on this run when a step may not fit one GPU (`dice train rl --plan`, with the task
    sets' longest prompt): said before the first rollout rather than met as an out-of-memory error minutes in. A
    warning, not an error: the plan's lengths are upper estimates (every response as long as allowed)."""
    longest = max(len(prompt_ids(tokenizer, t, phase, backend)) for phase, tasks in sets.items() for t in tasks)
    plan = rl_memory_plan(model_cfg, gpus, longest, cfg.rollout, cfg.update.micro_rows)
    checkpointing = cfg.parallel.activation_checkpointing
    if plan.fits(gpu_memory_gib, checkpointing):
        return None
    return (f"a step may not fit this GPU: the memory plan's peak is {plan.total(checkpointing) / GiB:.1f} GiB of "
            f"{gpu_memory_gib:.1f} (prompts of up to {longest} tokens, responses of {cfg.rollout.max_new_tokens}); "
            + "; ".join(rl_fit_advice(plan, gpu_memory_gib, checkpointing)) + " (details: dice train rl CONFIG --plan)")


def _run(cfg: RLConfig, resume: bool, dist: Dist, console: Console) -> Path:
    out = Path(cfg.out_dir)
    say = console.print if dist.is_main else (lambda *a, **k: None)
    previous = previous_state(out, resume, RLError)
    total = cfg.rl.total_steps
    if total < 1:
        raise RLError(f"rl.phase {cfg.rl.phase} has no steps: set rl.infill_steps / rl.e2e_steps")
    announce_config(cfg, out, dist, say)
    sets = _task_sets(cfg)
    curricula = {phase: Curriculum(tasks, cfg.rollout.tasks_per_step, cfg.tasks.order, cfg.tasks.seed)
                 for phase, tasks in sets.items()}
    say("tasks: " + ", ".join(f"{p} {len(t)}" for p, t in sets.items()) + f"; {total} steps of "
        f"{cfg.rollout.tasks_per_step} tasks x {cfg.rollout.group} rollouts on {dist.world_size} rank(s)")

    tokenizer = load_tokenizer_for(cfg.model)
    model = build_model(cfg.model, cfg.parallel, dist, tokenizer)
    optimizer = build_optimizer(model, cfg.optim)
    # with rows_per_update the count per step varies: at most one optimizer step per rollout
    per_step = (cfg.rollout.tasks_per_step * cfg.rollout.group if cfg.update.rows_per_update
                else cfg.update.updates_per_step)
    scheduler = build_scheduler(optimizer, total * per_step, cfg.optim)
    start = 0
    state = resumed_state(previous, resume, out, model, optimizer, dist, say)
    if state is not None:
        for phase, cur in curricula.items():
            cur.load_state_dict(state["curricula"][phase])
        scheduler.load_state_dict(state["scheduler"])
        start = state["step"]
        say(f"resumed from {previous} (step {start})")

    policy = rollout_policy(model, cfg.rollout.share_weights, param_dtype(cfg.parallel, dist.device), dist.device)
    try:
        rewards = RewardService(cfg.reward, out) if dist.is_main else None
    except ValueError as e:  # EvalConfig.check: e.g. backend cuda without a GPU
        raise RLError(f"reward: {e}") from None
    saves = RunSaves(out, model, optimizer, dist, cfg.checkpoint, cfg.model.tokenizer_dir,
                     lambda step: {"curricula": {p: c.state_dict() for p, c in curricula.items()},
                                   "scheduler": scheduler.state_dict()}, cfg.debug.sigkill_after_step)
    try:
        backend = _broadcast(cfg.reward.eval_config().resolved_backend() if dist.is_main else "")
        warnings = unrunnable_tasks(sets, backend)
        if dist.device.type == "cuda" and dist.is_main:
            gib = torch.cuda.get_device_properties(dist.device).total_memory / GiB
            warnings.append(memory_warning(cfg, sets, tokenizer, model.config, backend, dist.world_size, gib))
        for warning in filter(None, warnings):
            say(f"[yellow]warning:[/] {warning}")
        step_fn = RLStep(model, optimizer, tokenizer, rewards, cfg.rollout, cfg.update, cfg.optim.grad_clip,
                         attention_backend(cfg.parallel, dist.device), backend, dist, policy, scheduler)
        updates = 0
        with run_metrics(cfg, out, total, start, dist, console) as metrics:
            for step in range(start, total):
                phase = cfg.rl.phase_of(step)
                began, lr = time.perf_counter(), scheduler.get_last_lr()[0]
                stats = step_fn(step, phase, curricula[phase].next_batch())
                done = step + 1
                if cfg.rollout.save_texts:  # step numbers as in the candidate ids and rewards.sqlite (0-based)
                    save_rollouts(out / "rollouts" / f"step-{step:05d}.rank{dist.rank}.jsonl.gz",
                                  step_fn.last_rollouts, step_fn.last_rewards)
                values = {k: v for k, v in vars(stats).items() if k != "seconds"}
                values.update({f"{k}_s": round(v, 3) for k, v in stats.seconds.items()},
                              step_s=time.perf_counter() - began, lr=lr,
                              tokens_per_s=stats.tokens_generated / max(stats.seconds["rollout"], 1e-9))
                metrics.log(done, values)
                metrics.note(stats.line(done, total))
                updates += len(stats.updates)
                saves.after_step(done, total)
            final = saves.finish(total, trained=start < total or previous is None)
            if updates or start == total:
                ran = f"trained {total - start} step(s), {updates} optimizer update(s)"
            else:  # nothing moved: say so, and why, rather than "trained"
                ran = (f"0 updates in {total - start} step(s): weights unchanged. Every task's rollouts got one "
                       "reward (flat groups carry no advantage); see the outcomes per step above (needs_gpu: "
                       "CUDA tasks on the CPU backend, which none of the rollouts can pass)")
            metrics.note(f"{ran}; rewards per rollout: {out / 'rewards.sqlite'}"
                         + (f"; Hugging Face export: {final}" if cfg.checkpoint.at_end else ""))
    finally:
        if rewards is not None:
            rewards.close()
    return final

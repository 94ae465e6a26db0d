"""TraceRL's objective: replay each response's sampling trajectory. A token unmasked at denoising
step s of its block is scored with the model seeing the state before step s (earlier blocks clean, its block with
the tokens of steps >= s masked); every block and step of a batch of responses is scored in one forward."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dice_kernels.model.attention import (Attention, Layout, MaskMod, block_diffusion_mask_mod, dense_mask,
                                          flex_block_mask)
from dice_kernels.model.transformer import BlockDiffusionLM
from dice_kernels.train.logprobs import chosen_logprobs

LOG_RATIO_CLAMP = 10.0  # ratio = exp(clamp(logp_new - logp_old, ±10))
BACKENDS = ("flex", "dense")
# with flex, a step's micro-batches pad their rows to a multiple of this: compiled flex compiles once per shape
REPLAY_MULTIPLE = 1024


@dataclass(frozen=True)
class Trajectory:
    """One response as the sampler produced it (`decode`'s `tokens`, `unmask_steps`, `tail_tokens` and `tail_steps`
    for one row)."""

    prompt: list[int]
    tokens: list[int]  # generated token j sits at absolute position len(prompt) + j
    steps: list[int]  # the within-block denoising step that unmasked generated token j
    # the rest of the last block past the stop (or the cut), right after `tokens`: never scored, but unmasked in
    # the replayed states from their step on, as the sampler saw them
    tail: list[int] = field(default_factory=list)
    tail_steps: list[int] = field(default_factory=list)


@dataclass
class ReplayBatch:
    """The layout of one scoring forward: per row, [clean context | one noisy copy per (block, step) scored].

    Noisy copies share the positions of their block; `copy` (0 clean, s + 1 for the copy of step s) keeps the
    copies of one block from seeing each other. Rows are padded with a separate dummy sample (doc 1).
    """

    ids: Tensor  # [B, L]
    layout: Layout  # doc / pos / noisy, each [B, L]
    copy: Tensor  # [B, L]
    targets: Tensor  # [B, L] token scored at this (noisy) slot, -1 where none
    block_size: int

    @property
    def scored(self) -> Tensor:
        return self.targets >= 0

    def mask_mod(self) -> MaskMod:
        base = block_diffusion_mask_mod(self.layout, self.layout, self.block_size)
        copy, noisy = self.copy, self.layout.noisy

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            # a noisy key is seen only from its own copy (the block rule already limits it to its own block)
            return base(b, h, q_idx, kv_idx) & (~noisy[b, kv_idx] | (copy[b, q_idx] == copy[b, kv_idx]))

        return mask_mod


def _row(traj: Trajectory, block: int, mask_id: int) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """ids, pos, noisy, copy, targets of one trajectory's row (unpadded)."""
    if len(traj.tokens) != len(traj.steps) or not traj.tokens or len(traj.tail) != len(traj.tail_steps):
        raise ValueError("a trajectory needs one unmasking step per generated (and tail) token, and at least one token")
    scored = len(traj.prompt) + len(traj.tokens)  # positions from here on (the tail) are never scored
    seq = traj.prompt + traj.tokens + traj.tail
    step_at = [-1] * len(traj.prompt) + list(traj.steps) + list(traj.tail_steps)  # -1: prompt, revealed from the start
    first = len(traj.prompt) // block * block  # the first decode block (may hold the prompt's remainder)
    last = (scored - 1) // block * block  # the last block: its clean copy is never needed
    ids, pos = seq[:last], list(range(last))
    noisy, copy, targets = [0] * last, [0] * last, [-1] * last
    for start in range(first, last + 1, block):
        span = range(start, start + block)
        for s in sorted({step_at[p] for p in span if p < scored and step_at[p] >= 0}):
            for p in span:
                known = p < len(seq) and step_at[p] < s
                ids.append(seq[p] if known else mask_id)
                targets.append(seq[p] if p < scored and step_at[p] == s else -1)
            pos += list(span)
            noisy += [1] * block
            copy += [s + 1] * block
    return ids, pos, noisy, copy, targets


def _scored_states(traj: Trajectory, block_size: int) -> dict[int, set[int]]:
    """The denoising steps that unmasked a generated token, per block. Blocks lie on the sequence's grid, prompt
    included (the first may hold the prompt's remainder), as the sampler decodes them."""
    steps: dict[int, set[int]] = {}
    for j, s in enumerate(traj.steps):
        steps.setdefault((len(traj.prompt) + j) // block_size, set()).add(s)
    return steps


def denoising_rows(traj: Trajectory, block_size: int) -> int:
    """DICE's rows of a response: one per (block, denoising step) that unmasked a generated token, i.e. the states
    its replay scores (DICE's trainer feeds each as its own row; ours scores them all in one sequence)."""
    return sum(map(len, _scored_states(traj, block_size).values()))


def replay_length(traj: Trajectory, block_size: int) -> int:
    """Tokens in a trajectory's scoring row: its clean context and one block per (block, step) scored."""
    seq = len(traj.prompt) + len(traj.tokens)
    return (seq - 1) // block_size * block_size + block_size * denoising_rows(traj, block_size)


def flex_replay_length(longest: int) -> int:
    """The length flex micro-batches pad their rows to, whose longest scoring row has `longest` tokens."""
    return -(-longest // REPLAY_MULTIPLE) * REPLAY_MULTIPLE


def replay_batch(trajectories: list[Trajectory], block_size: int, mask_id: int, pad_id: int,
                 multiple: int = 1, length: int = 0, rows: int = 0) -> ReplayBatch:
    """The scoring layout of a batch of trajectories, rows padded to `length` tokens, or to the longest row rounded
    up to a multiple of `multiple`, and with rows of padding alone up to `rows` rows (compiled flex compiles one
    kernel per shape, batch size included: a trainer pads to few shapes). Padding rows score nothing."""
    if rows and len(trajectories) > rows:
        raise ValueError(f"{len(trajectories)} trajectories do not fit in rows={rows}")
    laid = [_row(t, block_size, mask_id) for t in trajectories]
    longest = max(len(r[0]) for r in laid)
    if length and longest > length:
        raise ValueError(f"a trajectory's scoring row has {longest} tokens, more than length={length}")
    length = length or -(-longest // multiple) * multiple
    laid += [([], [], [], [], [])] * (rows - len(laid))
    cols: list[list[list[int]]] = [[], [], [], [], [], []]
    for ids, pos, noisy, copy, targets in laid:
        tail = length - len(ids)
        # the padding is a sample of its own (doc 1), clean at position 0: it sees only itself, never a response
        for col, values, fill in zip(cols, (ids, pos, noisy, copy, targets, [0] * len(ids)),
                                     (pad_id, 0, 0, 0, -1, 1)):
            col.append(values + [fill] * tail)
    ids, pos, noisy, copy, targets, doc = (torch.tensor(c) for c in cols)
    return ReplayBatch(ids=ids, layout=Layout(doc=doc, pos=pos, noisy=noisy.bool()), copy=copy, targets=targets,
                       block_size=block_size)


def token_logprobs(model: BlockDiffusionLM, batch: ReplayBatch, backend: str = "dense",
                   temperature: float = 1.0) -> Tensor:
    """Log-probability of every scored token ([N], row-major over `batch.scored`) in its replayed state, from one
    forward (the lm_head a chunk of scored tokens at a time: `train.logprobs`). As in the sampler, the mask token is
    never a prediction; `temperature` is the rollout's (0, greedy, scores at 1)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    device = next(model.parameters()).device
    batch = _to(batch, device)
    rows, length = batch.ids.shape
    build = flex_block_mask if backend == "flex" else dense_mask
    mask = build(batch.mask_mod(), rows, length, length, device)
    hidden = model.hidden_states(batch.ids, batch.layout.pos, Attention(mask))
    scored = batch.scored
    return chosen_logprobs(hidden[scored], model.lm_head.weight, batch.targets[scored],
                           excluded=model.config.mask_token_id, temperature=temperature if temperature > 0 else 1.0)


def _to(batch: ReplayBatch, device: torch.device) -> ReplayBatch:
    lay = batch.layout
    return ReplayBatch(ids=batch.ids.to(device), copy=batch.copy.to(device), targets=batch.targets.to(device),
                       layout=Layout(lay.doc.to(device), lay.pos.to(device), lay.noisy.to(device)),
                       block_size=batch.block_size)


@dataclass
class LossTerms:
    loss: Tensor  # differentiable scalar: this micro-batch's share of the step's loss
    kl: Tensor  # [N] k3 estimate per scored token (detached)
    clipped: Tensor  # [N] bool: the clipped branch of PPO's min was taken (no gradient from the ratio)
    ratio: Tensor  # [N] detached


def policy_loss(logp_new: Tensor, logp_old: Tensor, advantages: Tensor, row_of_token: Tensor, norm_len: float,
                num_rows: int, clip: float = 0.2, kl_beta: float = 0.01) -> LossTerms:
    """PPO-clipped policy gradient plus β·k3 KL to the old policy, per token; each row's sum divided by
    `norm_len` (the step's padded response length), summed over rows and divided by `num_rows` (the step's rows,
    so micro-batches add up to the step's loss)."""
    log_ratio = (logp_new - logp_old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    adv = advantages[row_of_token]
    unclipped, clipped = ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv
    pg = -torch.minimum(unclipped, clipped)
    kl = (-log_ratio).exp() + log_ratio - 1  # k3 of KL(new || old): r - 1 - log r with r = p_old / p_new
    per_token = pg + kl_beta * kl
    return LossTerms(loss=per_token.sum() / norm_len / num_rows, kl=kl.detach(),
                     clipped=(clipped < unclipped).detach(), ratio=ratio.detach())


def row_of_scored(batch: ReplayBatch) -> Tensor:
    """Row index of each scored token, in `token_logprobs`' order."""
    return batch.scored.nonzero()[:, 0]

"""Model FLOPs of training forwards and backwards, counted from the tokens they actually process: the decoder's
matmuls per token, attention's quadratic term per (query, key) pair its mask allows, the lm_head per scored token,
padding apart from useful tokens. The RL update (`train/rl/trainer.py` RLStep.update_policy) is counted from its micro-batch
layouts (`tracerl.ReplayBatch`); `benchmarks/rl_step.py` turns the count into TFLOP/s and MFU.

Conventions (those of MFU): a matmul of [m, k] by [k, n] is 2·m·k·n FLOPs; a backward is twice its forward (the
input and the weight gradients); element-wise work (norms, RoPE, softmax, the loss) is not counted, nor is what
activation checkpointing recomputes. Attention counts the pairs its mask lets through (what FlexAttention computes,
up to its 128-slot tiles); dense SDPA computes every pair of the row and masks the rest afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dice_kernels.model.config import ModelConfig
from dice_kernels.train.rl.tracerl import ReplayBatch


@dataclass(frozen=True)
class ForwardWork:
    """What one forward processes, useful tokens and padding apart."""

    tokens: int  # useful tokens through the decoder layers
    pad_tokens: int  # padding tokens (rows of padding alone included)
    pairs: int  # (query, key) pairs the mask lets a useful query attend, per layer and head
    pad_pairs: int  # the same for padding queries
    scored: int  # tokens through the lm_head (only scored slots: `tracerl.token_logprobs`)


@dataclass(frozen=True)
class Flops:
    useful: float
    padding: float

    @property
    def total(self) -> float:
        return self.useful + self.padding

    @property
    def pad_share(self) -> float:
        return self.padding / self.total if self.total else 0.0

    def __add__(self, other: Flops) -> Flops:
        return Flops(self.useful + other.useful, self.padding + other.padding)

    def __mul__(self, k: float) -> Flops:
        return Flops(self.useful * k, self.padding * k)


def layer_matmul_params(cfg: ModelConfig) -> int:
    """Weights of the decoder layers' matmuls (q, k, v, o and the gated MLP), all layers: 2x this is the
    decoder's matmul FLOPs per token of a forward."""
    attn = cfg.hidden_size * cfg.head_dim * 2 * (cfg.num_attention_heads + cfg.num_key_value_heads)
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_hidden_layers * (attn + mlp)


def attention_pair_flops(cfg: ModelConfig) -> int:
    """Forward FLOPs of one (query, key) pair over all layers and query heads: q·k and p·v, 2·head_dim each."""
    return 4 * cfg.head_dim * cfg.num_attention_heads * cfg.num_hidden_layers


def forward_flops(cfg: ModelConfig, work: ForwardWork) -> Flops:
    """One forward's FLOPs; the lm_head's are useful (padding is never scored)."""
    per_token, per_pair = 2 * layer_matmul_params(cfg), attention_pair_flops(cfg)
    head = 2 * cfg.hidden_size * cfg.vocab_size * work.scored
    return Flops(useful=per_token * work.tokens + per_pair * work.pairs + head,
                 padding=per_token * work.pad_tokens + per_pair * work.pad_pairs)


def update_flops(cfg: ModelConfig, steps: list[list[ForwardWork]]) -> Flops:
    """The RL update's FLOPs from each optimizer step's micro-batches: a forward and backward of the policy per
    micro-batch (3 forwards' worth), and for the micro-batches of every step after the first the old policy's
    forward without gradient (RLStep.update_policy: the first step's rows are scored by the weights that rolled
    them out, so their old log-probs are their own, detached)."""
    def forwards(works: list[ForwardWork]) -> Flops:
        return sum((forward_flops(cfg, w) for w in works), Flops(0.0, 0.0))

    return sum((forwards(works) * (3 if k == 0 else 4) for k, works in enumerate(steps)), Flops(0.0, 0.0))


def replay_work(batch: ReplayBatch) -> ForwardWork:
    """Count one scoring forward's work from its layout. Padding is replay_batch's separate sample (doc != 0).

    The mask (ReplayBatch.mask_mod): a clean query sees the clean keys of its sample in its own and earlier blocks;
    a noisy query the clean keys of earlier blocks and the noisy keys of its own copy (same block, same step)."""
    lay, rows = batch.layout, batch.ids.shape[0]
    doc, block, noisy = lay.doc.long(), lay.pos.long() // batch.block_size, lay.noisy
    row = torch.arange(rows)[:, None].expand_as(doc)
    n_doc, n_block = int(doc.max()) + 1, int(block.max()) + 1
    # clean keys per (row, doc, block), cumulated over blocks: a clean query sees cum, a noisy one cum - own block
    group = (row * n_doc + doc) * n_block + block
    clean = torch.bincount(group[~noisy], minlength=rows * n_doc * n_block).view(rows * n_doc, n_block)
    cum = clean.cumsum(1).view(-1)
    seen = torch.where(noisy, cum[group] - clean.view(-1)[group], cum[group])
    # noisy keys of the query's own copy: the copy's noisy slots (one block, one step)
    copy_key = torch.stack([group, batch.copy.long()], -1)[noisy]
    if copy_key.numel():
        _, inverse, counts = torch.unique(copy_key, dim=0, return_inverse=True, return_counts=True)
        seen = seen.clone()
        seen[noisy] += counts[inverse]
    pad = doc != 0
    return ForwardWork(tokens=int((~pad).sum()), pad_tokens=int(pad.sum()), pairs=int(seen[~pad].sum()),
                       pad_pairs=int(seen[pad].sum()), scored=int(batch.scored.sum()))

"""The SFT objective of SDAR block diffusion (DESIGN.md §4): packed samples, a noisy copy beside the clean one with
shared positions, one t per sample, response-only masking, and loss = sum over masked tokens of CE / p, divided
by the number of response tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dice_kernels.model.attention import Attention, Layout, block_diffusion_mask_mod, dense_mask, flex_block_mask
from dice_kernels.model.transformer import BlockDiffusionLM

MIN_MASK_PROB = 1e-3  # p = (1 - eps) * t + eps, so no sample is trained with p = 0
BACKENDS = ("flex", "dense")


@dataclass
class PackedBatch:
    """Samples packed into rows; every field is [B, L]."""

    input_ids: Tensor  # clean tokens
    positions: Tensor  # position within the sample (blocks count from each sample's position 0)
    doc: Tensor  # sample index within its row
    response: Tensor  # bool: trained tokens (the response and its pad-to-block tail)


@dataclass
class Corruption:
    noisy_ids: Tensor  # [B, L] input_ids with the masked tokens replaced by the mask id
    masked: Tensor  # [B, L] bool
    mask_prob: Tensor  # [B, L] p of each token's sample


def pack(samples: list[tuple[list[int], list[int]]], block_size: int, pad_id: int,
         row_len: int | None = None) -> PackedBatch:
    """Pack (prompt ids, response ids) samples into rows of `row_len` tokens (default: one row holding all).

    Each sample is padded to a whole number of blocks with `pad_id` (SDAR: <|endoftext|>), labelled as response
    and trained, so every sample starts on the block grid. A row's unused tail is a dummy sample, not trained.
    """
    rows: list[list[tuple[list[int], list[bool]]]] = [[]]
    used = 0
    for prompt, response in samples:
        pad = -(len(prompt) + len(response)) % block_size
        ids = prompt + response + [pad_id] * pad
        trained = [False] * len(prompt) + [True] * (len(response) + pad)
        if row_len is not None and len(ids) > row_len:
            raise ValueError(f"a sample of {len(ids)} tokens (block-padded) does not fit in a row of {row_len}")
        if row_len is not None and used + len(ids) > row_len:
            rows.append([])
            used = 0
        rows[-1].append((ids, trained))
        used += len(ids)
    length = row_len or used
    fields: dict[str, list[list]] = {"input_ids": [], "positions": [], "doc": [], "response": []}
    for row in rows:
        tail = length - sum(len(ids) for ids, _ in row)
        row = row + [([pad_id] * tail, [False] * tail)] if tail else row
        fields["input_ids"].append([t for ids, _ in row for t in ids])
        fields["positions"].append([i for ids, _ in row for i in range(len(ids))])
        fields["doc"].append([d for d, (ids, _) in enumerate(row) for _ in ids])
        fields["response"].append([r for _, trained in row for r in trained])
    return PackedBatch(**{k: torch.tensor(v) for k, v in fields.items()})


def corrupt(batch: PackedBatch, mask_id: int, generator: torch.Generator | None = None) -> Corruption:
    """Draw t ~ U(0, 1) per sample and mask each response token independently with p = (1 - eps) t + eps."""
    device = batch.input_ids.device
    t = torch.rand(batch.doc.shape[0], int(batch.doc.max()) + 1, generator=generator, device=device)
    p = (1 - MIN_MASK_PROB) * t.gather(1, batch.doc) + MIN_MASK_PROB
    masked = batch.response & (torch.rand(p.shape, generator=generator, device=device) < p)
    return Corruption(noisy_ids=torch.where(masked, mask_id, batch.input_ids), masked=masked, mask_prob=p)


def noisy_hidden_states(model: BlockDiffusionLM, batch: PackedBatch, noisy_ids: Tensor, block_size: int,
                        backend: str = "flex") -> Tensor:
    """Hidden states [B, L, hidden] of the noisy copy, run as [noisy | clean] with shared positions.

    Each noisy block sees itself and the clean earlier blocks of its sample; clean tokens see clean tokens
    block-causally (the mask is `block_diffusion_mask_mod`). `flex` never builds the 2L x 2L mask; `dense`
    does, for SDPA (CPU training, and the benchmark's comparison).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    rows, length = batch.input_ids.shape
    noisy = torch.ones_like(batch.response)
    layout = Layout(batch.doc, batch.positions, noisy).cat(Layout(batch.doc, batch.positions, ~noisy))
    mask_mod = block_diffusion_mask_mod(layout, layout, block_size)
    build = flex_block_mask if backend == "flex" else dense_mask
    mask = build(mask_mod, rows, 2 * length, 2 * length, batch.input_ids.device)
    ids = torch.cat([noisy_ids, batch.input_ids], dim=1)
    positions = torch.cat([batch.positions, batch.positions], dim=1)
    return model.hidden_states(ids, positions, Attention(mask))[:, :length]


def sft_loss(model: BlockDiffusionLM, batch: PackedBatch, corruption: Corruption, block_size: int,
             backend: str = "flex") -> Tensor:
    """Sum over masked tokens of CE / p, divided by the number of response tokens in the batch.

    The lm_head runs on the masked positions only: the 150k-vocab logits of the other tokens are never needed.
    """
    hidden = noisy_hidden_states(model, batch, corruption.noisy_ids, block_size, backend)
    masked = corruption.masked
    logits = model.lm_head(hidden[masked]).float()
    ce = F.cross_entropy(logits, batch.input_ids[masked], reduction="none")
    return (ce / corruption.mask_prob[masked]).sum() / batch.response.sum().clamp(min=1)

"""The SFT objective of SDAR block diffusion: packed samples, a noisy copy beside the clean one with
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

    A noisy block without a trained token (prompt only) is seen by nothing but itself and yields no loss, so the
    dense path leaves it out of the noisy half (its rows are zeros): with long prompts that is much of the step.
    Flex keeps the full noisy half: compiled kernels want one shape per row length.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    rows, length = batch.input_ids.shape
    clean = Layout(batch.doc, batch.positions, torch.zeros_like(batch.response))
    if backend == "dense":
        take, valid = _trained_block_positions(batch.response, block_size)
        gather = take.clamp(max=length - 1)
        # left-out slots are a sample of their own (doc -1) at position 0: they see each other, nothing else
        noisy = Layout(torch.where(valid, batch.doc.gather(1, gather), -1),
                       torch.where(valid, batch.positions.gather(1, gather), 0), torch.ones_like(valid))
        noisy_ids = noisy_ids.gather(1, gather)
    else:
        noisy = Layout(batch.doc, batch.positions, torch.ones_like(batch.response))
    layout = noisy.cat(clean)
    total = layout.pos.shape[1]
    build = flex_block_mask if backend == "flex" else dense_mask
    mask = build(block_diffusion_mask_mod(layout, layout, block_size), rows, total, total, batch.input_ids.device)
    ids = torch.cat([noisy_ids, batch.input_ids], dim=1)
    hidden = model.hidden_states(ids, layout.pos, Attention(mask))[:, : total - length]
    if backend == "flex":
        return hidden
    full = hidden.new_zeros(rows, length + 1, hidden.shape[-1])  # column `length` takes the padding slots
    return full.scatter(1, take[..., None].expand_as(hidden), hidden)[:, :length]


def _trained_block_positions(response: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """The positions of every block (on the row's grid, where samples start) holding a trained token, in order,
    per row [B, N], and which are real [B, N] (rows with fewer are padded with position L)."""
    rows, length = response.shape
    trained = F.pad(response, (0, -length % block_size)).view(rows, -1, block_size).any(-1)
    keep = trained.repeat_interleave(block_size, dim=1)[:, :length]
    count = keep.sum(1)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, : int(count.max())]  # kept ones first
    valid = torch.arange(order.shape[1], device=response.device) < count[:, None]
    return torch.where(valid, order, length), valid


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

"""Per-step decisions of the block-diffusion sampler: which token each masked position would take (greedy,
temperature, top-k, top-p) with its confidence, and which positions to unmask now (static, dynamic, sequential)."""

from __future__ import annotations

import torch
from torch import Tensor

STRATEGIES = ("static", "dynamic", "sequential")


def sample_tokens(logits: Tensor, temperature: float, top_k: int, top_p: float,
                  generator: torch.Generator | None, draws: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Token and confidence (its probability under the distribution actually sampled) per position.

    logits [..., V] in fp32. temperature 0 (or top_k 1) is greedy; top_k 0 and top_p 1 switch those filters off.
    Sampling races the probabilities against `draws` (`exponentials` of the logits' shape), drawn from `generator`
    when not given.
    """
    if temperature == 0 or top_k == 1:
        probs = logits.softmax(-1)
        confidence, tokens = probs.max(-1)
        return tokens, confidence
    logits = logits / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # better tokens already reach top_p
        drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    if draws is None:
        draws = exponentials(probs.shape, generator, probs.device)
    # the exponential race, argmax of p / q with q ~ Exp(1): what torch.multinomial(probs, 1) draws from the same
    # random numbers, without its two validity passes over the 150k-vocab probabilities (a host sync in older
    # PyTorch), which a softmax's output never needs
    tokens = (probs / draws).argmax(-1)
    return tokens, probs.gather(-1, tokens[..., None])[..., 0]


def exponentials(shape: torch.Size, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """Exp(1) draws for `sample_tokens`: the random numbers torch.multinomial draws for one sample per row."""
    return torch.empty(shape, device=device).exponential_(generator=generator)


def transfer_count(masked_at_start: Tensor, step: Tensor, steps: int) -> Tensor:
    """Minimum tokens to unmask at `step` so a block with `masked_at_start` masks is done in `steps` forwards:
    an even split, the remainder going to the first steps (SDAR's schedule). At least 1 while masks remain."""
    count = masked_at_start // steps + (step < masked_at_start % steps).long()
    return count.clamp(min=1)


def choose_unmask(confidence: Tensor, masked: Tensor, count: Tensor, strategy: str, threshold: float) -> Tensor:
    """Bool [B, block]: positions to unmask now. `count` [B] is the per-row minimum.

    static: the `count` most confident masked positions; dynamic: every masked position with confidence above
    `threshold`, and at least the `count` most confident; sequential: the `count` leftmost masked positions.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    block = masked.shape[-1]
    position = torch.arange(block, device=masked.device)
    score = -position.expand_as(confidence).to(confidence.dtype) if strategy == "sequential" else confidence
    order = score.masked_fill(~masked, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, position.expand_as(order))
    chosen = masked & (rank < count[:, None])
    if strategy == "dynamic":
        chosen |= masked & (confidence > threshold)
    return chosen

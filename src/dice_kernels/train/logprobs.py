"""Log-probabilities of chosen tokens through the lm_head, a chunk of tokens at a time, forward and backward: the
[tokens, vocab] fp32 logits of a whole micro-batch never exist at once (at Qwen3's 151,936-entry vocabulary they
and their gradients cost ~14 bytes a token and entry: 8.1 GiB for a 4-row RL micro-batch of 1,024-token responses)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Tokens per chunk: ~1.2 GB of fp32 logits at Qwen3's vocabulary, and GEMMs still large enough to run at full rate.
CHUNK_TOKENS = 2048


def chosen_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, excluded: int | None = None,
                    temperature: float = 1.0, chunk_tokens: int = CHUNK_TOKENS) -> Tensor:
    """log softmax(hidden @ weight.T / temperature)[i, targets[i]] for each row i of `hidden` [N, H], in fp32 [N].
    The logits are computed in `hidden`'s dtype and then widened to fp32, as `F.linear(...).float()` does; the
    `excluded` token (the mask token: never a prediction) has probability 0. The backward recomputes each chunk's
    logits (one more lm_head GEMM a token) rather than keeping them."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return _ChosenLogProbs.apply(hidden, weight, targets, excluded, temperature, chunk_tokens)


def _logits(hidden: Tensor, weight: Tensor, excluded: int | None, temperature: float) -> Tensor:
    logits = F.linear(hidden, weight).float()
    if excluded is not None:
        logits[:, excluded] = float("-inf")
    return logits.div_(temperature) if temperature != 1.0 else logits


class _ChosenLogProbs(torch.autograd.Function):
    # Saved for backward: the inputs and each token's log-sum-exp; d logp_i / d logit_ij = [j == t_i] - softmax_ij.

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, excluded: int | None, temperature: float,
                chunk_tokens: int) -> Tensor:
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        for s in range(0, hidden.shape[0], chunk_tokens):
            part = slice(s, s + chunk_tokens)
            logits = _logits(hidden[part], weight, excluded, temperature)
            lse[part] = torch.logsumexp(logits, -1)
            out[part] = logits.gather(1, targets[part, None])[:, 0] - lse[part]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.excluded, ctx.temperature, ctx.chunk_tokens = excluded, temperature, chunk_tokens
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # summed over chunks in fp32, then given back in the weight's dtype as the unchunked backward gives it
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for s in range(0, hidden.shape[0], ctx.chunk_tokens):
            part = slice(s, s + ctx.chunk_tokens)
            h, g = hidden[part], grad_out[part].float()
            # in place over the chunk's logits: -g * softmax, then + g at the target
            grad = _logits(h, weight, ctx.excluded, ctx.temperature)
            grad.sub_(lse[part, None]).exp_().mul_(-g[:, None])
            grad.scatter_add_(1, targets[part, None], g[:, None])
            if ctx.temperature != 1.0:
                grad.div_(ctx.temperature)
            grad = grad.to(hidden.dtype)
            if want_hidden:
                grad_hidden[part] = grad @ weight
            if want_weight:
                grad_weight += grad.T @ h
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None

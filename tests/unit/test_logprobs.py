"""`chosen_logprobs` against the plain formula (the whole [N, vocab] logits through autograd): the same values and
gradients at any chunk size, and nothing of [N, vocab] kept for the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dice_kernels.train.logprobs import chosen_logprobs

N, H, V, EXCLUDED = 11, 8, 37, 36


def _plain(hidden, weight, targets, excluded, temperature):
    logits = F.linear(hidden, weight).float()
    if excluded is not None:
        logits[:, excluded] = float("-inf")
    return torch.log_softmax(logits / temperature, -1).gather(1, targets[:, None])[:, 0]


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, EXCLUDED, (N,), generator=g)
    upstream = torch.randn(N, generator=g)  # a loss that weighs the tokens differently, with both signs
    return hidden, weight, targets, upstream


def _values_and_grads(fn, hidden, weight, targets, upstream, **kw):
    hidden.grad = weight.grad = None
    out = fn(hidden, weight, targets, **kw)
    (out * upstream).sum().backward()
    return out.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("chunk", [1, 4, N, 64])
@pytest.mark.parametrize("excluded,temperature", [(EXCLUDED, 0.7), (None, 1.0)])
def test_values_and_gradients_equal_the_plain_formula_at_any_chunk(chunk, excluded, temperature):
    hidden, weight, targets, upstream = _inputs(torch.float64)
    want = _values_and_grads(_plain, hidden, weight, targets, upstream, excluded=excluded, temperature=temperature)
    got = _values_and_grads(chosen_logprobs, hidden, weight, targets, upstream, excluded=excluded,
                            temperature=temperature, chunk_tokens=chunk)
    for g, w in zip(got, want):  # both widen the logits to fp32: equal to fp32's rounding
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-6, atol=1e-5)
    assert got[0].dtype == torch.float32


def test_bf16_inputs_give_fp32_logprobs_and_bf16_gradients_close_to_the_plain_formula():
    hidden, weight, targets, upstream = _inputs(torch.bfloat16)
    want = _values_and_grads(_plain, hidden, weight, targets, upstream, excluded=EXCLUDED, temperature=0.7)
    got = _values_and_grads(chosen_logprobs, hidden, weight, targets, upstream, excluded=EXCLUDED,
                            temperature=0.7, chunk_tokens=4)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)  # the same bf16 GEMM, widened: equal forward
    for g, w in zip(got[1:], want[1:]):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


def test_the_excluded_token_gets_no_probability_and_no_gradient():
    hidden, weight, targets, upstream = _inputs(torch.float64)
    out = chosen_logprobs(hidden, weight, torch.full((N,), EXCLUDED), excluded=EXCLUDED)
    assert torch.isneginf(out).all()
    _, _, grad_w = _values_and_grads(chosen_logprobs, hidden, weight, targets, upstream, excluded=EXCLUDED)
    assert grad_w[EXCLUDED].abs().max() == 0 and grad_w[:EXCLUDED].abs().max() > 0


def test_nothing_of_tokens_by_vocab_is_kept_for_the_backward():
    """The plain formula keeps its [N, V] log-softmax for the backward; this keeps the inputs and N floats."""
    hidden, weight, targets, _ = _inputs(torch.float32)

    def kept(fn, **kw):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            fn(hidden, weight, targets, excluded=EXCLUDED, temperature=0.7, **kw)
        return sizes

    assert max(kept(_plain)) >= N * V  # the check sees what the plain formula keeps
    assert max(kept(chosen_logprobs, chunk_tokens=4)) == V * H  # the weight itself, nothing larger


@pytest.mark.parametrize("kw,message", [({"temperature": 0.0}, "temperature"), ({"chunk_tokens": 0}, "chunk_tokens")])
def test_bad_arguments_are_named(kw, message):
    hidden, weight, targets, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match=message):
        chosen_logprobs(hidden, weight, targets, **kw)

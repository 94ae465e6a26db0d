"""TraceRL's objective against a naive replay: the trajectory replayed one denoising state at a time, each state
a plain forward of the uncached model over [clean earlier blocks + the block as it was before that step]."""

from __future__ import annotations

import math

import pytest
import torch
from model_fixtures import VOCAB, tiny_model

from dice_kernels.model import Attention, Layout, block_diffusion_mask_mod, dense_mask
from dice_kernels.sampling.decoder import SamplingConfig, decode
from dice_kernels.train.rl.tracerl import (Trajectory, denoising_rows, policy_loss, replay_batch, replay_length,
                                           row_of_scored, token_logprobs)

BLOCK, MASK, PAD = 4, VOCAB - 1, 0
STOPS = list(range(40, 90))  # many stop ids, so some rows stop inside a block and some run to the limit
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _rollouts(model, temperature: float, strategy: str, seed: int = 0) -> list[Trajectory]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, VOCAB - 1, (n,), generator=g).tolist() for n in (5, 8, 3, 11)]
    out = decode(model, prompts, SamplingConfig(max_new_tokens=14, steps=4, strategy=strategy, threshold=0.3,
                                                temperature=temperature, use_cache=False, seed=seed), STOPS)
    return [Trajectory(p, t, s, tail, tail_steps) for p, t, s, tail, tail_steps in
            zip(prompts, out.tokens, out.unmask_steps, out.tail_tokens, out.tail_steps)]


def _naive_states(model, traj: Trajectory):
    """(logits of the block, tokens unmasked at step s, their positions in the block) per replayed state."""
    scored = len(traj.prompt) + len(traj.tokens)
    seq, steps = traj.prompt + traj.tokens + traj.tail, [-1] * len(traj.prompt) + traj.steps + traj.tail_steps
    for start in range(len(traj.prompt) // BLOCK * BLOCK, scored, BLOCK):
        span = [p for p in range(start, start + BLOCK)]
        for s in sorted({steps[p] for p in span if p < scored and steps[p] >= 0}):
            block = [seq[p] if p < len(seq) and steps[p] < s else MASK for p in span]
            ids = torch.tensor([seq[:start] + block])
            pos = torch.arange(ids.shape[1])[None]
            layout = Layout.clean(pos)  # the noisy block is the last one: it sees itself and the clean past
            length = ids.shape[1]
            mask = dense_mask(block_diffusion_mask_mod(layout, layout, BLOCK), 1, length, length, pos.device)
            logits = model(ids, pos, Attention(mask))[0, -BLOCK:].detach().double()
            logits[:, MASK] = float("-inf")
            chosen = [i for i, p in enumerate(span) if p < scored and steps[p] == s]
            yield logits, [seq[span[i]] for i in chosen], chosen


def _naive_logprobs(model, trajectories, temperature=1.0) -> list[list[float]]:
    rows = []
    for traj in trajectories:
        row = []
        for logits, tokens, chosen in _naive_states(model, traj):
            logp = torch.log_softmax(logits / temperature, -1)
            row += [float(logp[i, t]) for i, t in zip(chosen, tokens)]
        rows.append(row)
    return rows


@pytest.mark.parametrize("strategy", ["static", "dynamic"])
def test_replayed_states_are_the_states_the_sampler_saw(strategy):
    """Greedy decoding picks the argmax of each state: the naive replay must reproduce every choice, also in the
    last block of a row that stopped inside it (its tail past the stop token is replayed as the sampler saw it)."""
    model = tiny_model(3).double()
    trajectories = _rollouts(model, temperature=0.0, strategy=strategy)
    assert any(t.tail for t in trajectories)  # some row stopped inside a block
    checked = 0
    for traj in trajectories:
        for logits, tokens, chosen in _naive_states(model, traj):
            assert logits.argmax(-1)[chosen].tolist() == tokens
            checked += len(tokens)
    assert checked == sum(len(t.tokens) for t in trajectories) >= 20


def test_denoising_rows_count_the_states_the_replay_scores():
    """DICE's rows_per_update rule and the rollout's row-forwards count these, also where a prompt (5, 3 or 11
    tokens) ends inside a block and its first decode block holds the prompt's remainder."""
    model = tiny_model(3).double()
    trajectories = _rollouts(model, temperature=1.0, strategy="dynamic", seed=1)
    naive = [sum(1 for _ in _naive_states(model, t)) for t in trajectories]
    assert [denoising_rows(t, BLOCK) for t in trajectories] == naive
    assert any(len(t.prompt) % BLOCK for t in trajectories)


@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_batched_logprobs_equal_the_naive_replay(backend):
    model = tiny_model(1).double()
    trajectories = _rollouts(model, temperature=1.0, strategy="dynamic", seed=2)
    assert any(len(t.tokens) % BLOCK for t in trajectories)  # a stopped row ends inside a block
    assert len({len(t.tokens) for t in trajectories}) > 1
    # two rows of padding alone, as the trainer adds on flex to keep one batch shape: they score nothing
    batch = replay_batch(trajectories, BLOCK, MASK, PAD, multiple=16, rows=6)
    assert batch.ids.shape[0] == 6 and batch.ids.shape[1] % 16 == 0
    assert (batch.layout.doc == 0).sum(1).tolist() == [replay_length(t, BLOCK) for t in trajectories] + [0, 0]
    assert row_of_scored(batch).max().item() == len(trajectories) - 1
    with torch.no_grad():  # flex has no backward on CPU
        got = token_logprobs(model, batch, backend=backend, temperature=0.7)
    want = [x for row in _naive_logprobs(model, trajectories, temperature=0.7) for x in row]
    assert got.shape[0] == sum(len(t.tokens) for t in trajectories)  # every generated token scored once
    torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype), rtol=1e-6, atol=1e-6)  # RoPE angles are fp32


def test_loss_equals_the_naive_per_token_formula_and_has_a_gradient():
    model = tiny_model(2)
    trajectories = _rollouts(model, temperature=1.0, strategy="static", seed=5)
    batch = replay_batch(trajectories, BLOCK, MASK, PAD)
    g = torch.Generator().manual_seed(0)
    new = token_logprobs(model, batch)
    old = (new.detach() + 0.4 * torch.randn(new.shape, generator=g)).clamp(max=0)  # a policy a little way off
    old[0] = new[0].detach() - 12  # beyond the ±10 clamp
    adv = torch.tensor([1.5, -0.5, -1.0, 0.25])
    norm_len, rows, clip, beta = 20.0, 6, 0.2, 0.01  # rows: the step has more rows than this micro-batch
    terms = policy_loss(new, old, adv, row_of_scored(batch), norm_len, rows, clip, beta)

    naive_new = _naive_logprobs(model, trajectories)
    flat_old, k, want = old.tolist(), 0, 0.0
    for a, row in zip(adv.tolist(), naive_new):
        total = 0.0
        for lp in row:
            lr = max(-10.0, min(10.0, lp - flat_old[k]))
            r = math.exp(lr)
            total += -min(r * a, max(1 - clip, min(1 + clip, r)) * a) + beta * (math.exp(-lr) + lr - 1)
            k += 1
        want += total / norm_len
    assert terms.loss.item() == pytest.approx(want / rows, rel=1e-5)
    assert terms.clipped.any() and not terms.clipped.all()
    terms.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(x).all() for x in grads) and any(x.abs().sum() > 0 for x in grads)


@pytest.mark.gpu
def test_compiled_flex_equals_dense_on_cuda_and_has_a_backward():
    """On CUDA the trainer scores with compiled flex attention over rows padded to one length: the same log-probs
    as dense SDPA, and gradients through it."""
    model = tiny_model(1).cuda()
    trajectories = _rollouts(model, temperature=1.0, strategy="dynamic", seed=2)
    batch = replay_batch(trajectories, BLOCK, MASK, PAD, length=1024)
    flex = token_logprobs(model, batch, backend="flex")
    dense = token_logprobs(model, batch, backend="dense")
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-4)
    flex.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)

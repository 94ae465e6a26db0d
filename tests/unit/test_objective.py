"""The SFT objective: packing, corruption, the doubled [noisy | clean] forward and the loss, each against a direct
per-block computation that uses only a plain block-causal forward."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from model_fixtures import VOCAB, tiny_model

from dice_kernels.model import Attention, Layout, block_diffusion_mask_mod, dense_mask
from dice_kernels.train.sft.objective import MIN_MASK_PROB, corrupt, noisy_hidden_states, pack, sft_loss

BLOCK, PAD, MASK = 4, 0, VOCAB - 1
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager flex on CPU


def _samples(seed: int = 0) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [(3, 6), (5, 9), (1, 2), (8, 4)]  # none a whole number of blocks
    return [(torch.randint(5, VOCAB - 1, (p,), generator=g).tolist(), torch.randint(5, VOCAB - 1, (r,), generator=g).tolist())
            for p, r in lengths]


def _spans(batch):
    """(row, start, length) of every sample in the packed batch."""
    out = []
    for row in range(batch.doc.shape[0]):
        for d in batch.doc[row].unique().tolist():
            idx = (batch.doc[row] == d).nonzero()[:, 0]
            out.append((row, int(idx[0]), len(idx)))
    return out


def _direct_block_logits(model, clean, noisy, block):
    """Logits of noisy block `block` given the clean earlier blocks: one plain block-causal forward."""
    ids = torch.cat([clean[: block * BLOCK], noisy[block * BLOCK: (block + 1) * BLOCK]])[None]
    pos = torch.arange(ids.shape[1])[None]
    layout = Layout.clean(pos)  # the noisy block is simply the last block: it sees itself and what came before
    mask = dense_mask(block_diffusion_mask_mod(layout, layout, BLOCK), 1, ids.shape[1], ids.shape[1], pos.device)
    return model(ids, pos, Attention(mask))[0, -BLOCK:]


def test_pack_aligns_every_sample_to_the_block_grid():
    samples = _samples()
    batch = pack(samples, BLOCK, PAD, row_len=32)
    assert batch.input_ids.shape == (2, 32)  # block-padded 12 + 16 + 4 fill row 0; 12 goes to row 1
    spans = _spans(batch)
    for (prompt, response), (row, start, length) in zip(samples, spans):
        assert length % BLOCK == 0 and length == len(prompt) + len(response) + (-(len(prompt) + len(response)) % BLOCK)
        assert batch.positions[row, start: start + length].tolist() == list(range(length))
        ids = batch.input_ids[row, start: start + length].tolist()
        assert ids == prompt + response + [PAD] * (length - len(prompt) - len(response))
        trained = batch.response[row, start: start + length].tolist()
        assert trained == [False] * len(prompt) + [True] * (length - len(prompt))  # pad-to-block is trained
    tail = (batch.doc[1] == batch.doc[1].max())  # the unused end of row 1 is its own untrained sample
    assert not batch.response[1][tail].any() and tail.sum() == 32 - 12
    with pytest.raises(ValueError, match="does not fit"):
        pack(samples, BLOCK, PAD, row_len=8)


def test_corrupt_draws_one_t_per_sample_and_masks_only_responses():
    batch = pack(_samples() * 8, BLOCK, PAD)
    c = corrupt(batch, MASK, torch.Generator().manual_seed(0))
    assert not (c.masked & ~batch.response).any()
    assert torch.equal(c.noisy_ids, torch.where(c.masked, MASK, batch.input_ids))
    for d in batch.doc[0].unique():
        p = c.mask_prob[0][batch.doc[0] == d]
        assert (p == p[0]).all() and MIN_MASK_PROB <= p[0] <= 1
    assert 0 < c.masked.sum() < batch.response.sum()


@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_doubled_forward_equals_direct_forward_per_noisy_block(backend):
    """Every noisy block holding a trained token matches a direct forward. Prompt-only blocks (3 of 11 here) are
    computed by flex and left out by the dense path (returned as zeros)."""
    model = tiny_model()
    batch = pack(_samples(), BLOCK, PAD, row_len=32)
    c = corrupt(batch, MASK, torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = noisy_hidden_states(model, batch, c.noisy_ids, BLOCK, backend)
        logits = model.lm_head(hidden)
        checked = skipped = 0
        for row, start, length in _spans(batch)[:-1]:  # the last span is row 1's untrained tail
            clean = batch.input_ids[row, start: start + length]
            noisy = c.noisy_ids[row, start: start + length]
            for block in range(length // BLOCK):
                span = slice(start + block * BLOCK, start + (block + 1) * BLOCK)
                if backend == "dense" and not batch.response[row, span].any():
                    assert not hidden[row, span].any()
                    skipped += 1
                    continue
                torch.testing.assert_close(logits[row, span], _direct_block_logits(model, clean, noisy, block),
                                           rtol=1e-5, atol=1e-5)
                checked += 1
    assert checked + skipped == (12 + 16 + 4 + 12) // BLOCK and skipped == (3 if backend == "dense" else 0)


@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_loss_equals_a_naive_per_token_reference(backend):
    model = tiny_model()
    batch = pack(_samples(), BLOCK, PAD, row_len=32)
    c = corrupt(batch, MASK, torch.Generator().manual_seed(2))
    with torch.no_grad():
        loss = sft_loss(model, batch, c, BLOCK, backend)
        total = torch.zeros((), dtype=torch.float64)
        for row, start, length in _spans(batch):
            clean = batch.input_ids[row, start: start + length]
            noisy = c.noisy_ids[row, start: start + length]
            for i in range(length):
                if c.masked[row, start + i]:
                    logits = _direct_block_logits(model, clean, noisy, i // BLOCK)[i % BLOCK]
                    ce = -F.log_softmax(logits.double(), -1)[clean[i]]
                    total += ce / c.mask_prob[row, start + i].double()
        expected = total / batch.response.sum()
    assert c.masked.sum() > 5
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


def test_loss_backward_on_cpu_with_the_dense_mask():
    model = tiny_model()
    batch = pack(_samples(), BLOCK, PAD)
    loss = sft_loss(model, batch, corrupt(batch, MASK, torch.Generator().manual_seed(3)), BLOCK, "dense")
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0

"""The RL update's FLOP count (train/flops.py) against hand counts and against the mask itself."""

from __future__ import annotations

import pytest
import torch

from dice_kernels.model import ModelConfig, dense_mask
from dice_kernels.train.flops import ForwardWork, forward_flops, replay_work, update_flops
from dice_kernels.train.rl.tracerl import Trajectory, replay_batch

BLOCK, MASK, PAD = 4, 31, 0
# prompt at positions 0-1; block 0 unmasks positions 2, 3 at steps 0, 1; block 1 positions 4-7 at steps 0, 0, 1, 1
HAND = Trajectory(prompt=[10, 11], tokens=[20, 21, 22, 23, 24, 25], steps=[0, 1, 0, 0, 1, 1])
TINY = ModelConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=4, mask_token_id=MASK, dtype="float32")


def test_a_replay_row_is_counted_by_hand():
    # row: clean context (positions 0-3) + 2 copies of block 0 + 2 copies of block 1 = 20 tokens, padded to 24,
    # plus a row of padding alone
    work = replay_work(replay_batch([HAND], BLOCK, MASK, PAD, multiple=8, rows=2))
    # clean queries see the 4 clean keys of block 0; block 0's noisy queries their own copy (4);
    # block 1's noisy queries the 4 clean keys of block 0 and their own copy (8)
    assert work == ForwardWork(tokens=20, pad_tokens=4 + 24, pairs=4 * 4 + 8 * 4 + 8 * 8, pad_pairs=4 * 4 + 24 * 24,
                               scored=6)


def test_forward_and_update_flops_by_hand():
    work = ForwardWork(tokens=20, pad_tokens=28, pairs=112, pad_pairs=592, scored=6)
    per_token = 2 * 2 * (8 * 4 * 2 * (2 + 1) + 3 * 8 * 16)  # 2 FLOPs x (q, k, v, o + gate, up, down) x 2 layers
    per_pair = 2 * 2 * (2 * 4 + 2 * 4)  # 2 layers x 2 heads x (q.k + p.v)
    f = forward_flops(TINY, work)
    assert f.useful == per_token * 20 + per_pair * 112 + 2 * 8 * 32 * 6  # lm_head on scored slots only
    assert f.padding == per_token * 28 + per_pair * 592
    u = update_flops(TINY, [[work, work]])  # one optimizer step: forward and backward (3), two micro-batches
    assert (u.useful, u.padding) == (6 * f.useful, 6 * f.padding)
    # a second optimizer step's micro-batch also pays the old policy's forward, run before the first step
    assert update_flops(TINY, [[work], [work]]).total == (3 + 4) * f.total
    assert u.pad_share == pytest.approx(f.padding / f.total)


def test_pairs_are_those_the_replay_mask_lets_through():
    g = torch.Generator().manual_seed(0)
    trajs = []
    for prompt, new in ((3, 9), (6, 14), (4, 5)):
        steps = torch.randint(0, 3, (new,), generator=g).tolist()
        tail = (4 - (prompt + new) % 4) % 4
        trajs.append(Trajectory(list(range(1, prompt + 1)), list(range(5, 5 + new)), steps, [7] * tail, [2] * tail))
    batch = replay_batch(trajs, BLOCK, MASK, PAD, multiple=16, rows=4)
    rows, length = batch.ids.shape
    seen = dense_mask(batch.mask_mod(), rows, length, length, torch.device("cpu"))[:, 0].sum(-1)  # [B, L] keys
    pad = batch.layout.doc != 0
    work = replay_work(batch)
    assert (work.pairs, work.pad_pairs) == (int(seen[~pad].sum()), int(seen[pad].sum()))
    assert work.tokens + work.pad_tokens == rows * length and work.scored == sum(len(t.tokens) for t in trajs)

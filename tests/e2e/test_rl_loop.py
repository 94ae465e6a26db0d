"""BiC-RL end to end on CPU with real rewards: prompts -> block-diffusion rollouts -> the harness compiles and runs
the C++ candidates -> group advantages -> TraceRL update; and on a toy world the mean reward rises.

The toy world gives a tiny random model a real chance: its tokenizer's tokens are whole code fragments (the correct
ReLU kernel source, a kernel source with a syntax error, the whole correct program), so one or two sampled tokens
pick between a program that compiles and passes and one that fails. Every reward still comes from the harness
compiling and running the assembled program; all correct responses assemble the same program, so it compiles once.
"""

from __future__ import annotations

import sqlite3

import pytest
import torch
from conftest import EXAMPLES
from model_fixtures import tiny_model

from dice_kernels.data.infill import split_program
from dice_kernels.train.rl.curriculum import Curriculum, RLTask
from dice_kernels.train.rl.reward import RewardConfig, RewardService
from dice_kernels.train.rl.config import RolloutConfig, UpdateConfig
from dice_kernels.train.rl.trainer import PolicySnapshot, RLStep
from dice_kernels.train.rl.rollout import infill_core, response_candidate, rollout_prompt

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
SOLUTION = EXAMPLES / "solutions" / "cpu" / "level1" / "19_ReLU" / "correct.py"
PROGRAM = SOLUTION.read_text()
CUT = split_program(PROGRAM)
CORE_TYPO = CUT.core.replace('"""', '"', 1)  # an unterminated string: a Python syntax error, no compile
DISTRACTORS = ["pass", "cpp_source = None", "cpp_source = 0"]  # wrong programs that fail before any compile
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>", "[UNK]"]


def _toy_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + [CUT.core, CORE_TYPO, PROGRAM] + DISTRACTORS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    # prompts: the special tokens, and one token per paragraph (mostly [UNK]): short prompts, a fast test
    tok.pre_tokenizer = pre_tokenizers.Split("\n\n", behavior="removed")
    tok.decoder = decoders.Fuse()  # a response is its fragments, concatenated
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="[UNK]", mask_token="<|MASK|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    return fast


def _toy_model(tokenizer, seed=0):
    model = tiny_model(seed, vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id)
    with torch.no_grad():  # a small output layer: every token starts with about the same chance
        model.lm_head.weight.mul_(0.01)
    return model


def _task():
    reference = (EXAMPLES / "tasks" / "level1" / "19_ReLU.py").read_text()
    return RLTask(id="L1/19", level=1, reference=reference, prefix=CUT.prefix, suffix=CUT.suffix)


@pytest.fixture(scope="module")
def dist():
    from dice_kernels.train.distributed import init_distributed, shutdown

    yield init_distributed("cpu")
    shutdown()


def _step(tokenizer, model, rewards, dist, lr, group, max_new, seed=0):
    """The trainer's step on the toy model, sharded with FSDP2 as `dice train rl` does (a group of one here)."""
    from dice_kernels.train.config import OptimConfig, ParallelConfig
    from dice_kernels.train.distributed import parallelize
    from dice_kernels.train.optim import build_optimizer

    rollout = RolloutConfig(tasks_per_step=1, group=group, max_new_tokens=max_new, temperature=1.0,
                            strategy="dynamic", threshold=0.9, batch_rows=group, seed=seed)
    policy = PolicySnapshot(model, torch.float32, dist.device)
    parallelize(model, model.model.layers, ParallelConfig(), dist.device, forward_methods=("hidden_states",))
    optimizer = build_optimizer(model, OptimConfig(lr=lr, warmup_fraction=0.0))
    return RLStep(model, optimizer, tokenizer, rewards, rollout, UpdateConfig(micro_rows=8), 1.0, "dense", "cpu",
                  dist, policy)


def test_infill_core_extraction():
    assert infill_core(f"```python\n{PROGRAM}```")[0] == CUT.core  # the whole program: its core is cut out
    assert infill_core(f"Here:\n```python\n{CUT.core}\n```\n")[0] == CUT.core  # a fenced core alone
    assert infill_core(CUT.core + "\n")[0] == CUT.core  # a bare core
    assert infill_core(f"```python\n{CUT.core}")[0] is None  # truncated: no program
    assert infill_core("   ")[0] is None
    cand = response_candidate(_task(), "infill", CUT.core, id="x")
    assert cand.code == PROGRAM  # prefix + core + suffix is the program, byte for byte
    assert response_candidate(_task(), "e2e", PROGRAM, id="y").code == PROGRAM
    prompt = rollout_prompt(_task(), "infill", "cpu")
    assert "C++" in prompt and CUT.suffix.strip() in prompt and CUT.core not in prompt


def test_one_step_end_to_end_with_real_compiled_rewards(tmp_path, build_cache, dist):
    tokenizer = _toy_tokenizer()
    model = _toy_model(tokenizer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = RewardConfig(backend="cpu", trials=2, cache_dir=str(build_cache))
    with RewardService(cfg, tmp_path) as rewards:
        step = _step(tokenizer, model, rewards, dist, lr=1e-3, group=12, max_new=1)
        stats = step(0, "infill", [_task()])
    assert stats.rollouts == 12 and stats.tokens_generated == 12
    assert stats.outcomes.get("correct", 0) >= 1 and sum(stats.outcomes.values()) == 12
    assert set(stats.outcomes) - {"correct", "python_error", "compile_error", "generation_failure"} == set()
    assert stats.exec == stats.outcomes["correct"] / 12 == stats.reward_mean
    assert stats.trained_rollouts == 12 and stats.dropped_groups == 0
    assert stats.kl == pytest.approx(0, abs=1e-6) and stats.clip_fraction == 0  # one update: ratio 1 exactly
    after = {k: v.full_tensor() for k, v in model.state_dict().items()}  # FSDP2: DTensor shards of one rank
    changed = [k for k, v in after.items() if not torch.equal(v, before[k])]
    assert "lm_head.weight" in changed and any("layers.0" in k for k in changed)
    rows = sqlite3.connect(tmp_path / "rewards.sqlite").execute(
        "SELECT step, outcome, reward FROM rewards ORDER BY rollout").fetchall()
    assert len(rows) == 12 and all(r[0] == 0 and r[2] == (r[1] == "correct") for r in rows)
    assert (tmp_path / "harness" / "results.sqlite").exists()


def test_mean_reward_rises_on_the_toy_world(tmp_path, build_cache, dist):
    tokenizer = _toy_tokenizer()
    model = _toy_model(tokenizer, seed=1)
    cfg = RewardConfig(backend="cpu", trials=1, cache_dir=str(build_cache))
    means = []
    with RewardService(cfg, tmp_path) as rewards:
        step = _step(tokenizer, model, rewards, dist, lr=3e-2, group=16, max_new=1, seed=3)
        curriculum = Curriculum([_task()], per_step=1)
        for k in range(STEPS):
            stats = step(k, "infill", curriculum.next_batch())
            means.append(stats.reward_mean)
            print(k, stats.reward_mean, stats.seconds)
    # margin: the last two steps average at least 0.3 above the first two (fixed seeds)
    assert sum(means[-2:]) / 2 >= sum(means[:2]) / 2 + 0.3


STEPS = 5

"""Block-diffusion sampling: cached vs uncached decoding, strategies, trajectory record, stops, text generation
from a checkpoint directory, and the `dice generate` command."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
import typer
from model_fixtures import VOCAB, record_committing, save_tiny_checkpoint, tiny_model
from typer.testing import CliRunner

from dice_kernels.model import attention
from dice_kernels.model.attention import _flex_gqa as flex_gqa
from dice_kernels.model.transformer import LayerOps, attention_inputs, mlp_residual
from dice_kernels.sampling import Generator, SamplingConfig, decode, decoder
from dice_kernels.sampling.cli import generate
from dice_kernels.prompts import e2e_user
from dice_kernels.sampling import strategies
from dice_kernels.sampling.strategies import choose_unmask, sample_tokens, transfer_count

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15], [16], [17, 18, 19, 20, 21, 22]]  # 3, 8, 1, 6 tokens
NO_STOP = [VOCAB + 1]  # an id the model cannot produce


@pytest.fixture(scope="module")
def model64():
    return tiny_model().double()  # fp64: cached and uncached logits differ by ~1e-15, far below any tie


@pytest.mark.parametrize("strategy, temperature, top_k, top_p, threshold", [
    ("static", 0.0, 0, 1.0, 0.9),
    ("static", 1.0, 0, 1.0, 0.9),
    ("dynamic", 0.0, 0, 1.0, 0.05),  # a low threshold, so blocks finish in different numbers of steps
    ("dynamic", 0.8, 50, 0.9, 0.05),
    ("sequential", 1.0, 20, 1.0, 0.9),
])
def test_cached_and_uncached_decoding_produce_identical_tokens(model64, strategy, temperature, top_k, top_p,
                                                               threshold):
    cfg = SamplingConfig(max_new_tokens=13, steps=2, strategy=strategy, temperature=temperature, top_k=top_k,
                         top_p=top_p, threshold=threshold, seed=7)
    cached = decode(model64, PROMPTS, cfg, NO_STOP)
    uncached = decode(model64, PROMPTS, SamplingConfig(**{**cfg.__dict__, "use_cache": False}), NO_STOP)
    assert cached.tokens == uncached.tokens
    assert cached.unmask_steps == uncached.unmask_steps
    assert [len(t) for t in cached.tokens] == [13] * len(PROMPTS) and not any(cached.stopped)


def test_prompts_share_one_block_grid_from_position_zero(model64):
    """A prompt decoded in a batch gives what it gives alone, whatever the other prompts' lengths."""
    cfg = SamplingConfig(max_new_tokens=10, steps=4)
    batched = decode(model64, PROMPTS, cfg, NO_STOP)
    for i, prompt in enumerate(PROMPTS):
        alone = decode(model64, [prompt], cfg, NO_STOP)
        assert alone.tokens[0] == batched.tokens[i] and alone.unmask_steps[0] == batched.unmask_steps[i]


def test_trajectory_records_the_step_of_every_token(model64):
    # steps == block: one token per forward; prompt lengths 3, 8, 1, 6 leave 1, 4, 3, 2 masks in the first block.
    out = decode(model64, PROMPTS, SamplingConfig(max_new_tokens=12, steps=4), NO_STOP)
    for prompt, steps in zip(PROMPTS, out.unmask_steps):
        first = -len(prompt) % 4 or 4
        assert sorted(steps[:first]) == list(range(first))
        for b in range(first, 12 - 3, 4):
            assert sorted(steps[b: b + 4]) == [0, 1, 2, 3]
    # sequential unmasks left to right
    seq = decode(model64, [[5, 6, 7, 8]], SamplingConfig(max_new_tokens=8, steps=4, strategy="sequential"), NO_STOP)
    assert seq.unmask_steps[0] == [0, 1, 2, 3, 0, 1, 2, 3]
    # two tokens per forward: a block takes two forwards; no extra forward commits it to the cache
    two = decode(model64, [[5, 6, 7, 8]], SamplingConfig(max_new_tokens=16, steps=2), NO_STOP)
    assert all(sorted(two.unmask_steps[0][i: i + 4]) == [0, 0, 1, 1] for i in range(0, 16, 4))
    assert two.forwards == 8


@pytest.mark.parametrize("steps", [4, 2])
def test_rows_whose_prompts_end_inside_a_block_commit_in_step_with_the_others(model64, monkeypatch, steps):
    """A forward in which any row commits a block runs twice the queries for every row. Prompts of 3, 8, 1 and 6
    tokens leave 1, 4, 3 and 2 masks in their first blocks: a row sits out the forwards that make its first block end
    with a whole one's, so under static unmasking blocks are committed in one forward of every `steps` (without the
    wait: in nearly every forward), and each row's output is the one it gets decoded alone."""
    committing = record_committing(monkeypatch)
    cfg = SamplingConfig(max_new_tokens=17, steps=steps)
    out = decode(model64, PROMPTS, cfg, NO_STOP)
    assert [i for i, c in enumerate(committing) if c] == list(range(steps, len(committing), steps))
    alone = [decode(model64, [p], cfg, NO_STOP) for p in PROMPTS]
    assert out.tokens == [a.tokens[0] for a in alone] and out.unmask_steps == [a.unmask_steps[0] for a in alone]


def test_stop_token_ends_a_row_and_is_kept(model64):
    free = decode(model64, PROMPTS, SamplingConfig(max_new_tokens=16), NO_STOP)
    row = free.tokens[1]
    stop = next(t for t in row[5:] if t not in row[:5])  # a token that first appears after the first block
    cut = row.index(stop) + 1
    out = decode(model64, PROMPTS, SamplingConfig(max_new_tokens=16), [stop])
    assert out.tokens[1] == row[:cut] and out.stopped[1]
    assert out.unmask_steps[1] == free.unmask_steps[1][:cut]
    for i in (0, 2, 3):  # other rows only stop at their own first `stop`, if any
        expected = free.tokens[i][: free.tokens[i].index(stop) + 1] if stop in free.tokens[i] else free.tokens[i]
        assert out.tokens[i] == expected


@pytest.mark.parametrize("temperature, use_cache", [(0.0, True), (1.0, True), (1.0, False)])
def test_non_finite_logits_stop_decoding_with_an_error(temperature, use_cache):
    """A model whose logits turn NaN (here one lm_head row, so every softmax is NaN) gets an error that says so,
    greedy or sampled, rather than tokens that argmax or the sampling race picked from NaN."""
    model = tiny_model()
    with torch.no_grad():
        model.lm_head.weight[VOCAB // 2] = float("nan")
    cfg = SamplingConfig(max_new_tokens=8, temperature=temperature, seed=0, use_cache=use_cache)
    with pytest.raises(RuntimeError, match=r"non-finite logits \(NaN or inf\) after 1 decoding forward"):
        decode(model, PROMPTS, cfg, NO_STOP)


def test_dynamic_threshold_takes_fewer_forwards(model64):
    static = decode(model64, [[5, 6, 7, 8]], SamplingConfig(max_new_tokens=32, steps=4), NO_STOP)
    dynamic = decode(model64, [[5, 6, 7, 8]], SamplingConfig(max_new_tokens=32, steps=4, strategy="dynamic",
                                                             threshold=0.01), NO_STOP)
    assert static.forwards == 32
    assert dynamic.forwards < static.forwards


class _FavourToken(torch.nn.Module):
    """An lm_head that makes one token by far the most likely prediction everywhere."""

    def __init__(self, head: torch.nn.Module, token: int):
        super().__init__()
        self.head, self.token = head, token

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        logits[..., self.token] += 100
        return logits


def _traced_layer_ops() -> LayerOps:
    """The layer regions as whole graphs (fullgraph, as `compiled_ops` compiles them), run by aot_eager."""
    return LayerOps(*(torch.compile(f, fullgraph=True, backend="aot_eager") for f in (attention_inputs, mlp_residual)))


def test_layer_regions_trace_whole_and_decode_like_eager():
    """Each layer region traces as one graph (fullgraph, as `compiled_ops` compiles them), through a prefill shape
    and then the decode shapes (dynamic once the length changes), and gives eager's tokens. aot_eager runs the
    traced graphs: inductor's CPU code takes ~35 s to build (it too decoded the same tokens, checked by hand);
    the GPU test below runs inductor."""
    model = tiny_model()
    prompts = PROMPTS + [list(range(30, 30 + n)) for n in (37, 130)]
    traced = _traced_layer_ops()
    cfg = SamplingConfig(max_new_tokens=40, steps=2)
    with model.using_layer_ops(traced):
        compiled = decode(model, prompts, cfg, NO_STOP)
    eager = decode(model, prompts, cfg, NO_STOP)
    assert (compiled.tokens, compiled.unmask_steps) == (eager.tokens, eager.unmask_steps)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager flex on CPU
@pytest.mark.parametrize("strategy, temperature", [("static", 0.0), ("dynamic", 1.0)])
def test_cached_flex_attention_decodes_like_eager(monkeypatch, strategy, temperature):
    """Compiled decoding attends through flex over the whole KV cache (`cached_block_mask`) and proposes greedy or
    sampled tokens through one traced graph; run here on CPU (eager flex, regions and proposals traced by aot_eager)
    by letting compile=True act on CPU, it gives uncompiled decoding's tokens, with rows at different blocks and
    forwards that commit."""
    model = tiny_model()
    prompts = PROMPTS + [list(range(30, 30 + n)) for n in (37, 130)]
    traced = _traced_layer_ops()
    proposals = []
    traced_greedy = torch.compile(decoder._greedy_by_logsumexp, fullgraph=True, backend="aot_eager")
    traced_sampled = torch.compile(decoder._proposals, fullgraph=True, backend="aot_eager")
    monkeypatch.setattr(decoder, "_compiles", lambda cfg, device: cfg.compile)
    monkeypatch.setattr(decoder, "compiled_ops", lambda: traced)
    for name, trace in (("_compiled_greedy_proposals", traced_greedy), ("_compiled_sampled", traced_sampled)):
        monkeypatch.setattr(decoder, name, lambda trace=trace: lambda *a, **k: proposals.append(1) or trace(*a, **k))
    flex_calls = []
    monkeypatch.setattr(attention, "_flex_gqa", lambda *args: flex_calls.append(1) or flex_gqa(*args))
    cfg = SamplingConfig(max_new_tokens=40, steps=2, compile=True, strategy=strategy, temperature=temperature,
                         threshold=0.3, seed=3)
    compiled = decode(model, prompts, cfg, NO_STOP)
    assert flex_calls and proposals  # the decode forwards went through flex, their proposals through the trace
    eager = decode(model, prompts, SamplingConfig(**{**cfg.__dict__, "compile": False}), NO_STOP)
    assert (compiled.tokens, compiled.unmask_steps) == (eager.tokens, eager.unmask_steps)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager flex on CPU
@pytest.mark.parametrize("strategy, temperature", [("static", 0.0), ("dynamic", 1.0)])
def test_rows_decoding_one_prompt_read_it_from_one_copy_and_decode_as_unshared(monkeypatch, strategy, temperature):
    """Compiled decoding of prompts in runs (3 prompts x 8 rows, an RL group each; lengths ending inside a block, on
    a block boundary and past a flex block) keeps each prompt's K/V once per 4 rows (the tiny model's 2 x 4 queries
    of 2 heads a row fill 64 in 4 rows), and attends over it and over the rows' own slots separately, merged: the
    tokens of decoding without sharing, sampled rows drawing their own."""
    model = tiny_model()
    prompts = [list(range(30 + i, 30 + i + n)) for i, n in enumerate((6, 8, 131)) for _ in range(8)]
    monkeypatch.setattr(decoder, "_compiles", lambda cfg, device: cfg.compile)
    monkeypatch.setattr(decoder, "compiled_ops", _traced_layer_ops)
    shared_calls, prompt_caches = [], []
    monkeypatch.setattr(attention, "_prefix_then_rest",
                        lambda *args, real=attention._prefix_then_rest: shared_calls.append(1) or real(*args))
    monkeypatch.setattr(decoder, "KVCache", lambda *args, real=decoder.KVCache: prompt_caches.append(args) or real(*args))
    cfg = SamplingConfig(max_new_tokens=40, steps=2, compile=True, strategy=strategy, temperature=temperature,
                         threshold=0.3, seed=3, share_prompts=True)
    shared = decode(model, prompts, cfg, NO_STOP)
    assert shared_calls and [args[1] for args in prompt_caches] == [24, 6]  # the rows' cache, then one per 4 rows
    if temperature:
        assert len({tuple(t) for t in shared.tokens}) > 3  # a run's rows sample apart
    shared_calls.clear()
    unshared = decode(model, prompts, SamplingConfig(**{**cfg.__dict__, "share_prompts": False}), NO_STOP)
    assert not shared_calls
    assert (shared.tokens, shared.unmask_steps) == (unshared.tokens, unshared.unmask_steps)


def test_prompt_runs_are_found_only_where_every_row_of_a_run_has_its_prompt_and_share_copies_by_the_tile():
    a, b, short = [1] * 9, [2] * 9, [3] * 3
    assert decoder.prompt_runs([a, a, b, b], block=4) == 2
    assert decoder.prompt_runs([a, a, a, a], block=4) == 4
    assert decoder.prompt_runs([a, a, b, b, b], block=4) == 1  # runs of unequal length
    assert decoder.prompt_runs([a, b, a, b], block=4) == 1
    assert decoder.prompt_runs([a, a, b, a], block=4) == 1
    assert decoder.prompt_runs([short, short], block=4) == 1  # no whole block before the first decode block
    assert decoder.prompt_runs([a], block=4) == 1
    # a copy serves as many rows as fit flex-decoding's 64-query tile when they commit (SDAR: 2 x 4 queries x 2 heads)
    assert [decoder.rows_per_prompt_copy(8, q) for q in (16, 8, 64, 128)] == [4, 8, 1, 1]
    assert decoder.rows_per_prompt_copy(6, 16) == 3


def test_the_mask_token_is_never_generated():
    model = tiny_model()
    model.lm_head = _FavourToken(model.lm_head, model.config.mask_token_id)
    out = decode(model, [[5, 6, 7]], SamplingConfig(max_new_tokens=8), NO_STOP)
    assert model.config.mask_token_id not in out.tokens[0]


def test_greedy_by_logsumexp_proposes_the_softmax_maximum():
    """Compiled decoding's greedy proposal (the max logit and exp(max - logsumexp)) against the eager one (the max of
    the softmax): the same tokens and, up to fp32 rounding, the same confidences, from bf16 logits; the mask token is
    never proposed, even where it holds a row's largest logit."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 4, 500, generator=generator) * 4).to(torch.bfloat16)
    mask_id = 7
    logits[0, :, mask_id] = 100
    tokens, confidence = decoder._greedy_by_logsumexp(logits.clone(), mask_id)
    expected_tokens, expected = decoder._proposals(logits.clone(), mask_id=mask_id, temperature=0.0, top_k=0,
                                                   top_p=1.0, generator=None)
    assert torch.equal(tokens, expected_tokens) and not (tokens == mask_id).any()
    torch.testing.assert_close(confidence, expected, rtol=1e-5, atol=1e-7)


def test_choose_unmask_strategies():
    conf = torch.tensor([[0.2, 0.95, 0.5, 0.91]])
    masked = torch.tensor([[True, True, True, False]])
    one = torch.tensor([1])
    assert choose_unmask(conf, masked, one, "static", 0.9).tolist() == [[False, True, False, False]]
    assert choose_unmask(conf, masked, torch.tensor([2]), "static", 0.9).tolist() == [[False, True, True, False]]
    assert choose_unmask(conf, masked, one, "sequential", 0.9).tolist() == [[True, False, False, False]]
    low = choose_unmask(conf, masked, one, "dynamic", 0.4)  # everything above 0.4, unmasked positions excluded
    assert low.tolist() == [[False, True, True, False]]
    high = choose_unmask(conf, masked, one, "dynamic", 0.99)  # nothing above: the minimum, most confident first
    assert high.tolist() == [[False, True, False, False]]
    with pytest.raises(ValueError):
        choose_unmask(conf, masked, one, "random", 0.9)


def test_transfer_count_splits_a_block_over_the_steps():
    masks = torch.tensor([4, 4, 3, 1])
    counts = [transfer_count(masks, torch.full_like(masks, s), 2).tolist() for s in range(2)]
    assert counts == [[2, 2, 2, 1], [2, 2, 1, 1]]  # the last is the clamp: at least one while masks remain
    assert [transfer_count(torch.tensor([6]), torch.tensor([s]), 4).item() for s in range(4)] == [2, 2, 1, 1]


def test_sample_tokens_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(2000, -1)
    g = torch.Generator().manual_seed(0)
    tokens, conf = sample_tokens(logits, 0.0, 0, 1.0, g)
    assert (tokens == 0).all() and torch.allclose(conf, torch.tensor(0.5))
    tokens, conf = sample_tokens(logits, 1.0, 2, 1.0, g)
    assert set(tokens.tolist()) == {0, 1}
    assert torch.allclose(conf[tokens == 0], torch.tensor(0.5 / 0.8))
    tokens, _ = sample_tokens(logits, 1.0, 0, 0.7, g)  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: keep two
    assert set(tokens.tolist()) == {0, 1}
    tokens, _ = sample_tokens(logits, 1.0, 0, 1.0, g)
    assert set(tokens.tolist()) == {0, 1, 2, 3}


def test_sampling_draws_what_multinomial_draws_from_the_same_generator():
    """The exponential race is torch.multinomial's one-draw algorithm on the same random numbers, without its
    validity passes; proposals from draws given (as compiled decoding passes them) are those the generator draws,
    and never the mask token."""
    logits = torch.randn(6, 4, 300) * 3
    draw = torch.Generator().manual_seed(11)
    tokens, conf = sample_tokens(logits, 0.7, 0, 1.0, draw)
    probs = (logits / 0.7).softmax(-1)
    expected = torch.multinomial(probs.view(-1, 300), 1, generator=torch.Generator().manual_seed(11)).view(6, 4)
    assert torch.equal(tokens, expected)
    assert torch.allclose(conf, probs.gather(-1, tokens[..., None])[..., 0])
    logits[..., 5] = 50.0  # the mask token would win every draw
    drawn = decoder._proposals(logits.clone(), mask_id=5, temperature=0.7, top_k=0, top_p=1.0,
                               generator=torch.Generator().manual_seed(2))
    draws = strategies.exponentials(logits.shape, torch.Generator().manual_seed(2), logits.device)
    given = decoder._proposals(logits, mask_id=5, temperature=0.7, top_k=0, top_p=1.0, generator=None, draws=draws)
    assert torch.equal(given[0], drawn[0]) and (given[0] != 5).all()
    torch.testing.assert_close(given[1], drawn[1])


# ---------------------------------------------------------------- text level: checkpoint, chat, CLI


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    save_tiny_checkpoint(directory)
    return directory


def test_generator_returns_text_ids_and_steps(checkpoint):
    gen = Generator.from_checkpoint(checkpoint)
    results = gen(["hello world", "write a cuda kernel for relu"], SamplingConfig(max_new_tokens=10, seed=0,
                                                                                  temperature=1.0))
    for r in results:
        assert len(r.token_ids) == len(r.unmask_steps) <= 10
        body = r.token_ids[:-1] if r.stopped else r.token_ids
        assert r.text == gen.tokenizer.decode(body)
        assert gen.tokenizer.decode(r.prompt_ids).endswith("<|im_start|>assistant\n")
    assert results[0].prompt_ids != results[1].prompt_ids


def test_kernelbench_prompt_holds_the_task():
    task = "import torch\nclass Model(torch.nn.Module):\n    pass\n"
    prompt = e2e_user(task)
    assert task.rstrip() in prompt and "ModelNew" in prompt and "Do not output testing code" in prompt
    assert prompt.index("class ModelNew") < prompt.index(task.rstrip())  # the example comes first


def _cli() -> typer.Typer:
    app = typer.Typer()
    app.command("generate")(generate)
    app.command("other")(lambda: None)  # two commands, so `generate` is a subcommand as in `dice`
    return app


def test_generate_cli(checkpoint, tmp_path):
    task = tmp_path / "19_ReLU.py"
    task.write_text("import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n"
                    "def get_inputs():\n    return []\ndef get_init_inputs():\n    return []\n")
    runner = CliRunner()
    out = tmp_path / "solution.md"
    result = runner.invoke(_cli(), ["generate", "-c", str(checkpoint), "--task", str(task), "--out", str(out),
                                    "--max-new-tokens", "8", "--temperature", "1", "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert out.read_text() in result.output
    result = runner.invoke(_cli(), ["generate", "-c", str(checkpoint), "-p", "hello", "--max-new-tokens", "4",
                                    "--strategy", "dynamic"])
    assert result.exit_code == 0, result.output
    bad = runner.invoke(_cli(), ["generate", "-c", str(checkpoint)])
    assert bad.exit_code != 0 and "exactly one of --prompt or --task" in bad.output
    bad = runner.invoke(_cli(), ["generate", "-c", str(checkpoint), "-p", "x", "--out", str(tmp_path / "a.py")])
    assert bad.exit_code != 0
    helped = runner.invoke(_cli(), ["generate", "--help"])
    assert "--checkpoint" in helped.output and "dynamic" in helped.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cached_decoding_on_gpu_matches_uncached():
    model = tiny_model().cuda()
    cfg = SamplingConfig(max_new_tokens=12, steps=2)
    cached = decode(model, PROMPTS, cfg, NO_STOP)
    uncached = decode(model, PROMPTS, SamplingConfig(**{**cfg.__dict__, "use_cache": False}), NO_STOP)
    assert cached.tokens == uncached.tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy, temperature, steps", [("static", 0.0, 4), ("static", 0.0, 2),
                                                           ("dynamic", 1.0, 4)])
def test_cuda_graph_and_eager_decoding_give_identical_tokens(dtype, strategy, temperature, steps):
    """Graph replay is the eager forward recorded: same tokens and trajectories, across many captured shapes
    (300 new tokens cross several 128-slot spans, with and without committing rows)."""
    model = tiny_model().to("cuda", dtype)
    prompts = PROMPTS + [list(range(30, 30 + n)) for n in (37, 130, 250)]
    cfg = SamplingConfig(max_new_tokens=300, steps=steps, strategy=strategy, temperature=temperature,
                         threshold=0.3, seed=3)
    graphed = decode(model, prompts, cfg, NO_STOP)
    eager = decode(model, prompts, SamplingConfig(**{**cfg.__dict__, "cuda_graphs": False}), NO_STOP)
    assert graphed.tokens == eager.tokens
    assert graphed.unmask_steps == eager.unmask_steps
    assert graphed.forwards == eager.forwards


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphs_kept_from_an_earlier_call_decode_other_prompts_like_eager():
    """The second call of a shape replays the first call's graphs with its own prompts, cache and stop ids."""
    model = tiny_model().to("cuda", torch.bfloat16)
    cfg = SamplingConfig(max_new_tokens=100, steps=2)
    eager_cfg = SamplingConfig(**{**cfg.__dict__, "cuda_graphs": False})
    first = [list(range(40, 40 + n)) for n in (3, 50, 70, 9)]
    second = [list(range(60, 60 + n)) for n in (20, 1, 77, 64)]  # other lengths, the same 128-slot bucket
    decode(model, first, cfg, [7])
    graphed = decode(model, second, cfg, [7])  # replays the first call's graphs
    eager = decode(model, second, eager_cfg, [7])
    assert (graphed.tokens, graphed.unmask_steps, graphed.stopped) == (eager.tokens, eager.unmask_steps, eager.stopped)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("strategy, temperature", [("static", 0.0), ("dynamic", 1.0)])
def test_compiled_layers_in_cuda_graphs_decode_like_eager(strategy, temperature):
    """`compile=True` (inductor-fused layer regions, flex-decoding attention over the cache and fused greedy or
    sampled proposals, captured into the graphs after a warm-up forward of each new shape) gives the tokens and
    trajectories of eager uncompiled decoding, in fp32 where rounding cannot flip a token; a second call replays the
    graphs the first one kept; with `rows=2` the rows take waiting prompts between replays."""
    model = tiny_model().cuda()
    prompts = PROMPTS + [list(range(30, 30 + n)) for n in (37, 130)]
    cfg = SamplingConfig(max_new_tokens=150, steps=2, compile=True, strategy=strategy, temperature=temperature,
                         threshold=0.3, seed=3)
    eager_cfg = SamplingConfig(**{**cfg.__dict__, "compile": False, "cuda_graphs": False})
    compiled = decode(model, prompts, cfg, NO_STOP)
    eager = decode(model, prompts, eager_cfg, NO_STOP)
    assert (compiled.tokens, compiled.unmask_steps) == (eager.tokens, eager.unmask_steps)
    assert decode(model, prompts, cfg, NO_STOP).tokens == eager.tokens
    # two rows at a time: a row at max_new_tokens takes the next prompt, prefilled between graph replays (sampled
    # rows draw other random numbers than the whole batch does, so the reference decodes two rows at a time too)
    refilled = decode(model, prompts, cfg, NO_STOP, rows=2)
    eager_refilled = decode(model, prompts, eager_cfg, NO_STOP, rows=2)
    assert (refilled.tokens, refilled.unmask_steps) == (eager_refilled.tokens, eager_refilled.unmask_steps)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_sampling_of_rl_rollout_shapes_runs():
    """An RL step's rollouts at SDAR-1.7B's attention shape (16 query heads over 8 kv heads of 128): 128 rows of
    KernelBench-length prompts, 256 sampled tokens each, compiled. With a 1,284-slot cache (prompts up to 926 tokens,
    a cache ending inside a flex block) inductor's flex-decoding kernel failed every autotuned config with an
    illegal memory access on an H100; the cache now holds whole flex blocks."""
    from dice_kernels.model import BlockDiffusionLM, ModelConfig

    cfg = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, mask_token_id=1023)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = BlockDiffusionLM(cfg).to(torch.bfloat16).eval()
    lengths = (790, 795, 803, 804, 807, 809, 811, 818, 821, 838, 845, 848, 854, 875, 926, 926)
    prompts = [[(7 * i + j) % 1000 for j in range(n)] for i, n in enumerate(lengths) for _ in range(8)]
    sampling = SamplingConfig(max_new_tokens=256, strategy="dynamic", temperature=1.0, seed=0, compile=True)
    out = decode(model, prompts, sampling, [])  # no stop id: NO_STOP is an ordinary token of this vocabulary
    assert [len(t) for t in out.tokens] == [256] * 128
    assert decoder._WORKSPACES[model].forward.cache.k.shape[3] % attention.FLEX_BLOCK == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_decoding_of_rollout_groups_reads_each_prompt_once_and_decodes_as_unshared(dtype):
    """Inductor's two flex-decoding kernels (a run's prompt, the rows' own slots) and their merge, in CUDA graphs, at
    SDAR-1.7B's attention shape: 4 prompts of 200-330 tokens x 8 rows, greedy. fp32 gives unshared decoding's tokens.
    bf16 rounds the two partial outputs before merging them, so a near tie can go the other way and a row's later
    tokens with it: there a run's rows agree with each other, and most rows' first block with unshared decoding's."""
    from dice_kernels.model import BlockDiffusionLM, ModelConfig

    cfg = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, mask_token_id=1023)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = BlockDiffusionLM(cfg).to(dtype).eval()
    prompts = [[(7 * i + j) % 1000 for j in range(n)] for i, n in enumerate((200, 255, 301, 330)) for _ in range(8)]
    sampling = SamplingConfig(max_new_tokens=128, compile=True, share_prompts=True)
    shared = decode(model, prompts, sampling, [])
    assert decoder._WORKSPACES[model].forward.prompts.k.shape[1] == 8  # one copy per 4 rows: 64 queries a tile
    unshared = decode(model, prompts, dataclasses.replace(sampling, share_prompts=False), [])
    assert decoder._WORKSPACES[model].forward.prompts is None
    if dtype == torch.float32:
        assert shared.tokens == unshared.tokens
    else:
        assert all(shared.tokens[i] == shared.tokens[i - i % 8] for i in range(32))
        assert sum(s[:4] == u[:4] for s, u in zip(shared.tokens, unshared.tokens)) >= 24


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_whose_response_ended_takes_the_next_waiting_prompt(model64, temperature):
    """`rows=2` over six prompts: a row freed by a stop token takes the next prompt (its prompt prefilled into that
    row's cache) while the other row goes on. Greedy, each prompt gets what it gets in one batch of six, trajectory
    and tail included; sampled, the responses come back in prompt order with their own stops. Either way it takes
    fewer forwards than two-prompt batches one after another, which wait for their longest response."""
    prompts = PROMPTS + [[30, 31, 32, 33, 34], [40, 41]]
    stops = [253, 300, 57]  # the first, third and fourth prompts' greedy responses hit one within 4 tokens
    cfg = SamplingConfig(max_new_tokens=24, steps=2, temperature=temperature, seed=3)
    forwards, handed = [0], []  # decode forwards so far; (prompt, response, forwards when it was handed over)
    hook = model64.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    try:
        refilled = decode(model64, prompts, cfg, stops, rows=2, on_response=lambda i, r: handed.append((i, r, forwards[0])))
    finally:
        hook.remove()
    chunks = [decode(model64, prompts[i: i + 2], cfg, stops) for i in range(0, 6, 2)]
    assert refilled.forwards < sum(c.forwards for c in chunks)
    for i, tokens in enumerate(refilled.tokens):
        assert refilled.stopped[i] == (tokens[-1] in stops) and len(tokens) <= 24
        assert len(refilled.unmask_steps[i]) == len(tokens)
    # every response is handed over once, the same as returned; a row's, when it takes a waiting prompt, before the
    # call's last forward (a caller can keep it even if the call never returns)
    assert sorted(i for i, _, _ in handed) == list(range(6))
    for i, r, _ in handed:
        assert (r.tokens, r.unmask_steps, r.stopped) == (refilled.tokens[i], refilled.unmask_steps[i],
                                                         refilled.stopped[i])
    assert handed[0][2] < refilled.forwards == forwards[0]
    if temperature == 0:
        together = decode(model64, prompts, cfg, stops)
        assert sum(together.stopped) >= 3
        for field_ in ("tokens", "unmask_steps", "stopped", "tail_tokens", "tail_steps"):
            assert getattr(refilled, field_) == getattr(together, field_), field_
        assert refilled.tokens == [t for c in chunks for t in c.tokens]


def test_release_graphs_frees_what_compiled_flex_calls_still_hold():
    """torch.compile'd flex attention keeps its inputs in a reference cycle until the cycle collector runs (pytorch
    issue #195866): compiled decoding's views of its KV cache would keep the whole cache through the training update
    that follows the rollouts. With automatic collection off, only release_graphs can have freed it."""
    from torch.nn.attention.flex_attention import create_block_mask

    compiled = torch.compile(flex_gqa, backend="eager", fullgraph=True)
    cache = torch.randn(2, 1, 2, 128, 16)  # (k and v) x batch x kv heads x slots x head dim
    mask = create_block_mask(lambda b, h, q, k: k <= q + 124, 1, 1, 4, 128, device="cpu")
    alive = weakref.ref(cache)
    collecting = gc.isenabled()
    gc.disable()
    try:
        compiled(torch.randn(1, 4, 4, 16), cache[0], cache[1], mask)  # views, as the decoder passes
        del cache
        decoder.release_graphs(tiny_model())
        assert alive() is None
    finally:
        if collecting:
            gc.enable()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_release_graphs_frees_the_compiled_decoders_cache():
    """What an RL step needs before its update: after release_graphs the compiled, graphed decoder's KV cache is
    gone and its memory back with the allocator (38 GiB for 128 rollouts at SDAR-4B's shape)."""
    model = tiny_model().cuda()
    decode(model, PROMPTS, SamplingConfig(max_new_tokens=150, steps=2, compile=True), NO_STOP)
    cache = decoder._WORKSPACES[model].forward.cache
    alive, nbytes = weakref.ref(cache.k), cache.k.nbytes + cache.v.nbytes
    del cache
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    decoder.release_graphs(model)
    assert alive() is None
    assert held - torch.cuda.memory_allocated() >= nbytes

"""The SDAR/Qwen3 model core: parity with transformers' Qwen3, the block-diffusion mask, checkpoint I/O, tokenizer."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from model_fixtures import VOCAB, save_tiny_checkpoint, save_tiny_tokenizer, tiny_config, tiny_model

from dice_kernels.model import (Attention, CheckpointError, ConfigError, Layout, ModelConfig,
                                block_diffusion_mask_mod, dense_mask, flex_block_mask, load_config, load_model,
                                save_model)
from dice_kernels.model import attention
from dice_kernels.model.attention import attend, cached_block_mask, cached_mask_mod, fold_gqa_mask
from dice_kernels.model.tokenizer import chat_prompt, load_tokenizer, stop_token_ids

CPU = torch.device("cpu")
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager flex on CPU


def causal(pos: torch.Tensor) -> torch.Tensor:
    """The plain causal mask: block diffusion with block size 1 and only clean tokens."""
    layout = Layout.clean(pos)
    return dense_mask(block_diffusion_mask_mod(layout, layout, 1), *pos.shape, pos.shape[1], CPU)


def mask_for(pos: torch.Tensor, backend: str, block_size: int = 1):
    layout = Layout.clean(pos)
    build = flex_block_mask if backend == "flex" else dense_mask
    return build(block_diffusion_mask_mod(layout, layout, block_size), *pos.shape, pos.shape[1], CPU)


# ---------------------------------------------------------------- (1) parity with transformers


def _hf_qwen3(directory, tied: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
                      tie_word_embeddings=tied, max_position_embeddings=512)
    hf = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # make every weight matter, norms included (they start at 1)
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    hf.save_pretrained(directory)
    return hf


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("model_type", ["qwen3", "sdar"])
@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_transformers_qwen3_checkpoint_reproduces_its_logits(tmp_path, tied, model_type, backend):
    hf = _hf_qwen3(tmp_path, tied)
    if model_type == "sdar":  # SDAR's config.json: same weights, another model_type, no block/mask keys
        config = json.loads((tmp_path / "config.json").read_text())
        config.update(model_type="sdar", architectures=["SDARForCausalLM"])
        (tmp_path / "config.json").write_text(json.dumps(config))
    ours = load_model(tmp_path)
    assert ours.config.tie_word_embeddings == tied
    assert ours.config.block_size == 4  # SDAR's default; no mask token fits this tiny vocabulary
    assert ours.config.mask_token_id is None
    ids = torch.randint(0, VOCAB, (3, 37), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(37).expand(3, -1)
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours(ids, pos, Attention(mask_for(pos, backend)))
    assert expected.abs().max() > 1  # logits far from zero, so the comparison means something
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_by_roll_is_qwens_rotate_half_bit_for_bit(dtype):
    from dice_kernels.model.transformer import apply_rope, rope_cos_sin

    x = torch.randn(2, 5, 3, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 100, 4095, 9, 31]])
    angles = pos[..., None].float() * (1.0 / 1e6 ** (torch.arange(0, 16, 2).float() / 16))
    angles = torch.cat([angles, angles], -1)[:, :, None]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = x * cos + torch.cat([-x[..., 8:], x[..., :8]], -1) * sin  # transformers' Qwen3 apply_rotary_pos_emb
    assert torch.equal(apply_rope(x, *rope_cos_sin(pos, 16, 1e6, dtype)), expected)


# ---------------------------------------------------------------- the block-diffusion mask


def _reference_visible(qd, qp, qn, kd, kp, kn, block):
    """The SDAR rule written out per pair, independently of the vectorised mask_mod."""
    if qd != kd:
        return False
    qb, kb = qp // block, kp // block
    if qn:
        return kb == qb if kn else kb < qb
    return (not kn) and kb <= qb


def test_logits_of_a_slice_from_frozen_weights_take_one_gemm():
    """Sampling keeps the last block of a committing forward (a strided slice) with weights that need no grad:
    matmul then runs a batched GEMM that reads the whole lm_head weight once per row (2.3x a committing forward at
    the 1.7B shape, batch 128) unless the slice is made contiguous first."""
    model = tiny_model().requires_grad_(False)
    ids = torch.randint(0, VOCAB - 1, (3, 8))
    pos = torch.arange(8).expand(3, -1)
    with torch.inference_mode(), torch.profiler.profile(record_shapes=True) as prof:
        kept = model(ids, pos, Attention(causal(pos)), keep=slice(-4, None))
    lm_head_gemms = [e for e in prof.events() if e.name in ("aten::mm", "aten::bmm")
                     and any(shape and shape[-1] == VOCAB for shape in e.input_shapes)]
    assert [e.name for e in lm_head_gemms] == ["aten::mm"]
    with torch.inference_mode():
        full = model(ids, pos, Attention(causal(pos)))
    torch.testing.assert_close(kept, full[:, -4:])


def _packed_doubled_layout():
    lengths = [8, 5, 11]  # three samples of different lengths packed in one row
    doc = torch.tensor([[d for d, n in enumerate(lengths) for _ in range(n)]])
    pos = torch.tensor([[i for n in lengths for i in range(n)]])
    noisy = torch.ones_like(doc, dtype=torch.bool)
    return Layout(doc, pos, noisy).cat(Layout(doc, pos, ~noisy))


def test_mask_mod_matches_the_rule_pair_by_pair():
    layout = _packed_doubled_layout()
    n = layout.pos.shape[1]
    got = dense_mask(block_diffusion_mask_mod(layout, layout, 4), 1, n, n, CPU)[0, 0]
    d, p, z = layout.doc[0].tolist(), layout.pos[0].tolist(), layout.noisy[0].tolist()
    expected = torch.tensor([[_reference_visible(d[i], p[i], z[i], d[j], p[j], z[j], 4) for j in range(n)]
                             for i in range(n)])
    assert torch.equal(got, expected)
    assert got.diagonal().all()  # every token sees itself: no empty softmax rows


@pytest.mark.parametrize("block", [1, 4])
def test_the_cached_rule_is_the_block_rule_over_a_decoding_cache(block):
    """Decoding's one-comparison mask (`cached_mask_mod`) against the SDAR rule for what a decode forward sends: each
    row's current block as noisy queries, after, in a committing forward, its finished block as clean ones (or, for
    a row not committing, a copy of its current block), over a cache whose slots from the current block on are
    noisy. Rows at different blocks, a row at slot 0, every slot of the cache (later ones stale)."""
    generator = torch.Generator().manual_seed(0)
    batch, slots = 16, 40 * block
    start = torch.randint(0, 30, (batch,), generator=generator) * block
    start[0] = 0
    commit = (torch.rand(batch, generator=generator) < 0.5) & (start > 0)
    cur = start[:, None] + torch.arange(block)
    k_pos = torch.arange(slots).expand(batch, -1)
    keys = Layout(torch.zeros_like(k_pos), k_pos, k_pos >= start[:, None])
    first = torch.where(commit[:, None], cur - block, cur)
    for q_pos, noisy in ((cur, torch.ones_like(cur, dtype=torch.bool)),
                         (torch.cat([first, cur], 1), torch.cat([~commit[:, None].expand_as(cur),
                                                                 torch.ones_like(cur, dtype=torch.bool)], 1))):
        rule = block_diffusion_mask_mod(Layout(torch.zeros_like(q_pos), q_pos, noisy), keys, block)
        expected = dense_mask(rule, batch, q_pos.shape[1], slots, CPU)
        assert expected.any(-1).all()  # every query sees something
        assert torch.equal(dense_mask(cached_mask_mod(q_pos, block), batch, q_pos.shape[1], slots, CPU), expected)


def test_flex_block_mask_and_dense_mask_agree():
    layout = _packed_doubled_layout()
    n = layout.pos.shape[1]
    mask_mod = block_diffusion_mask_mod(layout, layout, 4)
    flex = flex_block_mask(mask_mod, 1, n, n, CPU).to_dense()  # block-level: 128-token tiles
    assert flex.shape[-2:] == (1, 1) and bool(flex.all())
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (1, n))
    with torch.no_grad():
        dense_out = model(ids, layout.pos, Attention(dense_mask(mask_mod, 1, n, n, CPU)))
        flex_out = model(ids, layout.pos, Attention(flex_block_mask(mask_mod, 1, n, n, CPU)))
    torch.testing.assert_close(flex_out, dense_out, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tied", [False, True])
def test_save_load_round_trip_is_bit_exact(tmp_path, dtype, tied):
    model = tiny_model(tie_word_embeddings=tied).to(dtype)
    save_model(model, tmp_path / "a")
    loaded = load_model(tmp_path / "a")
    assert loaded.config == replace(model.config, dtype=str(dtype).removeprefix("torch."))
    assert next(loaded.parameters()).dtype == dtype
    original, again = model.state_dict(), loaded.state_dict()
    assert original.keys() == again.keys()
    for name in original:
        assert torch.equal(original[name].view(torch.uint8), again[name].view(torch.uint8)), name
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied


def test_sharded_checkpoint_round_trip(tmp_path):
    model = tiny_model()
    save_model(model, tmp_path, max_shard_bytes=40_000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    loaded = load_model(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def test_load_casts_to_the_requested_dtype(tmp_path):
    save_model(tiny_model(), tmp_path)
    assert next(load_model(tmp_path, dtype=torch.bfloat16).parameters()).dtype == torch.bfloat16


def _rewrite_weights(directory, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing \\['model.layers.1.mlp.up_proj.weight'\\]"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}),
     "unexpected \\['model.layers.0.self_attn.q_proj.bias'\\]"),
    (lambda t: t.update({"model.norm.weight": torch.ones(65)}), "model.norm.weight: \\(65,\\) in the file, \\(64,\\)"),
])
def test_bad_tensors_are_named(tmp_path, edit, message):
    save_model(tiny_model(), tmp_path)
    _rewrite_weights(tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path)


def test_unsupported_configs_are_rejected(tmp_path):
    save_model(tiny_model(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for bad, match in ((dict(model_type="llama"), "model_type"), (dict(attention_bias=True), "attention_bias"),
                       (dict(rope_scaling={"rope_type": "yarn", "factor": 4}), "RoPE")):
        (tmp_path / "config.json").write_text(json.dumps(config | bad))
        with pytest.raises(ConfigError, match=match):
            load_config(tmp_path)
    with pytest.raises(CheckpointError, match="config.json"):
        load_config(tmp_path / "nowhere")


def test_missing_block_size_and_mask_id_get_sdar_defaults(tmp_path):
    big = ModelConfig.from_hf(tiny_config(vocab_size=151936).to_hf())
    hf = big.to_hf()
    del hf["block_size"], hf["mask_token_id"]
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.block_size, cfg.mask_token_id) == (4, 151669)
    # With a tokenizer that declares a mask token, its id is the default.
    save_tiny_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["mask_token_id"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(tmp_path)
    assert load_config(tmp_path).mask_token_id == tokenizer.convert_tokens_to_ids("<|MASK|>")


# ---------------------------------------------------------------- tokenizer and chat format


def test_tokenizer_chat_format_and_stop_tokens(tmp_path):
    save_tiny_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    vocab = tok.get_vocab()
    assert stop_token_ids(tok) == (vocab["<|im_end|>"], vocab["<|endoftext|>"])
    text = chat_prompt(tok, "hello world", system="be brief")
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == vocab["<|im_start|>"] and tok.decode(ids) == text
    tok.chat_template = None  # no template shipped: Qwen's ChatML is the fallback
    assert chat_prompt(tok, "hello world", system="be brief") == text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_flex_matches_dense_on_gpu():
    layout = _packed_doubled_layout()
    layout = Layout(*(t.cuda() for t in (layout.doc, layout.pos, layout.noisy)))
    n = layout.pos.shape[1]
    mask_mod = block_diffusion_mask_mod(layout, layout, 4)
    model = tiny_model().cuda()
    ids = torch.randint(0, VOCAB, (1, n), device="cuda")
    dev = torch.device("cuda")
    dense_out = model(ids, layout.pos, Attention(dense_mask(mask_mod, 1, n, n, dev)))
    flex_out = model(ids, layout.pos, Attention(flex_block_mask(mask_mod, 1, n, n, dev)))
    torch.testing.assert_close(flex_out, dense_out, rtol=1e-4, atol=1e-4)
    flex_out.sum().backward()  # compiled flex has a backward on GPU


def _cached_attention_case(device: torch.device, dtype: torch.dtype, queries: int, kv_len: int, head_dim: int = 16):
    """A decode forward's attention inputs over a 260-slot cache, 8 query heads over 2 kv heads (SDAR's ratio): rows
    at different blocks (block 4), the first and last committing their finished block as clean queries when `queries`
    is 8. Returns q, k, v, the mask_mod over every slot (`cached_block_mask`'s) and the one over [0, kv_len) (the
    matmul path's)."""
    batch, q_heads, kv_heads, slots, block = 3, 8, 2, 260, 4
    start = torch.tensor([kv_len - 28, kv_len - 100, kv_len - 4], device=device)
    cur = start[:, None] + torch.arange(block, device=device)
    noisy = torch.ones_like(cur, dtype=torch.bool)
    if queries == 2 * block:
        commit = torch.tensor([True, False, True], device=device)[:, None]
        cur = torch.cat([torch.where(commit, cur - block, cur), cur], 1)
        noisy = torch.cat([~commit.expand(-1, block), noisy], 1)
    q = torch.randn(batch, queries, q_heads, head_dim, device=device, dtype=dtype).transpose(1, 2)
    k, v = (torch.randn(batch, kv_heads, slots, head_dim, device=device, dtype=dtype) for _ in range(2))

    def mask_mod(keys: int):
        k_pos = torch.arange(keys, device=device).expand(batch, -1)
        return block_diffusion_mask_mod(Layout(torch.zeros_like(cur), cur, noisy),
                                        Layout(torch.zeros_like(k_pos), k_pos, k_pos >= start[:, None]), block)

    return q, k, v, mask_mod(slots), mask_mod(kv_len)


def _matmul_attention(q, k, v, mask_mod, kv_len: int) -> torch.Tensor:
    batch, q_heads, queries, _ = q.shape
    bias = fold_gqa_mask(dense_mask(mask_mod, batch, queries, kv_len, q.device), q_heads // k.shape[1], k.shape[1],
                         q.dtype)
    return attend(q, k[:, :, :kv_len], v[:, :, :kv_len], bias)


@pytest.mark.parametrize("queries", [4, 8])
def test_flex_over_the_whole_cache_matches_the_matmul_path_over_the_span(queries):
    """Compiled decoding's attention (flex over every cache slot, key blocks past the span unlisted) gives the
    uncompiled matmul path's output over the span; traced whole (fullgraph, aot_eager as in the sampling tests), one
    graph per query count serves every span and every forward's fresh mask_mod (no recompiles)."""
    counter = CompileCounterWithBackend("aot_eager")
    traced = torch.compile(attention._flex_gqa, fullgraph=True, dynamic=False, backend=counter)
    for kv_len in (128, 256):
        q, k, v, over_cache, over_span = _cached_attention_case(CPU, torch.float32, queries, kv_len)
        mask = cached_block_mask(over_cache, q.shape[0], queries, kv_len, k.shape[2], CPU)
        expected = _matmul_attention(q, k, v, over_span, kv_len)
        torch.testing.assert_close(attend(q, k, v, mask, cached=True), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(traced(q, k, v, mask), expected, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def test_a_flex_decoding_tile_is_parsed_and_reaches_flex_as_its_kernel_options(monkeypatch):
    # on the CPU `attend` runs flex eagerly without it; the compiled call's use of it is the GPU test below
    monkeypatch.setattr(attention, "FLEX_DECODING_TILE", None)
    monkeypatch.setattr(attention, "FLEX_DECODING_AUTOTUNE", False)
    attention.configure_flex_decoding("64,1,4")
    assert attention.FLEX_DECODING_TILE == {"BLOCK_N": 64, "num_stages": 1, "num_warps": 4}
    with pytest.raises(ValueError, match="'32,3': expected inductor, auto or BLOCK_N,num_stages,num_warps"):
        attention.configure_flex_decoding("32,3")
    attention.configure_flex_decoding("auto")
    assert attention.FLEX_DECODING_AUTOTUNE and attention.FLEX_DECODING_TILE is None
    attention.configure_flex_decoding("inductor")
    assert not attention.FLEX_DECODING_AUTOTUNE and attention.FLEX_DECODING_TILE is None
    attention.configure_flex_decoding()  # the default: the tile measured fastest (docs/bench.md), not autotuned
    assert not attention.FLEX_DECODING_AUTOTUNE
    assert attention.FLEX_DECODING_TILE == {"BLOCK_N": 32, "num_stages": 3, "num_warps": 2}
    calls = []
    real_flex = attention.flex_attention
    monkeypatch.setattr(attention, "flex_attention",
                        lambda *a, **kw: calls.append(kw["kernel_options"]) or real_flex(*a, **kw))
    q, k, v, over_cache, over_span = _cached_attention_case(CPU, torch.float32, 4, 128)
    mask = cached_block_mask(over_cache, q.shape[0], 4, 128, k.shape[2], CPU)
    tile = {"BLOCK_N": 32, "num_stages": 3, "num_warps": 2}
    torch.testing.assert_close(attention._flex_gqa(q, k, v, mask, tile), _matmul_attention(q, k, v, over_span, 128),
                               rtol=1e-5, atol=1e-5)
    assert calls == [tile]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tile", [None, {"BLOCK_N": 32, "num_stages": 3, "num_warps": 2}])
@pytest.mark.parametrize("queries", [4, 8])
def test_compiled_flex_over_the_cache_in_a_cuda_graph_matches_the_matmul_path(queries, tile, monkeypatch):
    """The inductor flex-decoding kernel at SDAR's head_dim and GQA ratio, bf16, replayed from a CUDA graph captured
    after a warm-up call (as the decoder does) with the mask built inside the capture; with inductor's default tile
    and with a fixed one (`configure_flex_decoding`)."""
    monkeypatch.setattr(attention, "FLEX_DECODING_TILE", tile)
    dev = torch.device("cuda")
    q, k, v, over_cache, over_span = _cached_attention_case(dev, torch.bfloat16, queries, 256, head_dim=128)

    def run() -> torch.Tensor:
        return attend(q, k, v, cached_block_mask(over_cache, q.shape[0], queries, 256, k.shape[2], dev), cached=True)

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    torch.testing.assert_close(out, _matmul_attention(q, k, v, over_span, 256), rtol=2e-2, atol=2e-2)


def test_compiled_flex_raises_the_recompile_limit_and_never_lowers_it(monkeypatch):
    """Past torch._dynamo's recompile limit (8) compiled flex runs eager and materialises every score: the RL
    update's shapes (rows x lengths x grad mode) exceed 8, so making the compiled flex raises the limit."""
    import torch._dynamo.config as dynamo_config

    monkeypatch.setattr(dynamo_config, "recompile_limit", 8)
    attention._compiled_flex.cache_clear()
    attention._compiled_flex()
    assert dynamo_config.recompile_limit == attention.FLEX_RECOMPILE_LIMIT > 8
    monkeypatch.setattr(dynamo_config, "recompile_limit", 500)
    attention.allow_flex_recompiles()
    assert dynamo_config.recompile_limit == 500
